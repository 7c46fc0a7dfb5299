/* A product with 4- and 5-bit weights (GGUF Q4_0, Q4_1, Q4_K; Q5_0, Q5_1) as integer dot
 * products, one fixed order of arithmetic per output.
 *
 * Why: torch's int4 kernel takes bf16 activations and widens every weight to floats for
 * every row it is given; on a 2-core AVX512-BF16 EPYC all 210 SmolLM2 layer products took
 * 4.5 ms at one row and 42.6 ms at 32. Here, as llama.cpp multiplies Q4_1 by Q8_1, each
 * activation row is rounded to int8 per block of 32 with a float32 scale, and a weight's
 * 4-bit codes (unsigned, 0..15) meet those int8s in one integer dot instruction (VNNI's
 * vpdpbusd, else AVX2's vpmaddubsw + vpmaddwd: the same exact int32s).
 *
 * Weights are packed by runtime/kernels/native.py `pack_lowbit` in groups of 8 rows, so that
 * lane j of every vector is output row j of the group and one block's dot of a whole
 * group is 8 instructions with no horizontal sums (the layout of llama.cpp's x86 "repack"
 * kernels, written here for the per-row float scale and min of GGUF's 4-bit types):
 *
 *   per group g, per block b of 32 columns, GROUP_BYTES = 160 bytes:
 *   [0, 128)   codes: byte c * 32 + j * 4 + i holds row j's code 4c + i in its low nibble
 *              and code 16 + 4c + i in its high one (c in 0..3, j in 0..7, i in 0..3)
 *   [128, 144) the 8 rows' scales, IEEE half
 *   [144, 160) the 8 rows' mins, IEEE half (weight = code * scale + min)
 *
 * Built with -DCODE_BITS=5 (GGUF Q5_0, Q5_1: codes 0..31), 32 bytes of fifth bits follow
 * the nibbles: bit j * 4 + i of the little-endian uint32 at 128 + 4t is bit 4 of row j's
 * code 4t + i; scales and mins move to [160, 176) and [176, 192).
 *
 * out[m, n] = D + M, where D sums dot_b(codes[n], xq[m]) * (scale[n, b] * xs[m, b]) and M
 * sums min[n, b] * (xs[m, b] * sum_b(xq[m])) over blocks b in block order, each block's dot
 * exact (int32) and one float32 fma per term. Tiles decide only
 * which rows share a loaded block, never an output's arithmetic, and a row is quantized
 * alone: a row's result does not depend on how many rows there are or how the threads
 * split them (runtime/kernels/int8_rows.c and paged_attention.c hold to the same rule).
 *
 * x            [rows, k] float32, C-contiguous, k a multiple of 32
 * input_scale  [k] float32 multiplied into x first (a preceding RMSNorm's weight), or NULL
 * packed       [n_pad / 8, k / 32, GROUP_BYTES] uint8, n_pad = n rounded up to 8
 * out          [rows, n] float32
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "lowbit_rows.c needs AVX2, FMA and F16C (every CPU llmq runs on has them)"
#endif

#define BLOCK 32
#define GROUP 8
#ifndef CODE_BITS
#define CODE_BITS 4
#endif
#if CODE_BITS == 4
#define CODE_BYTES 128
#elif CODE_BITS == 5 /* the nibbles, then the fifth bits: 8 planes of 32 bits */
#define CODE_BYTES 160
#else
#error "CODE_BITS is 4 or 5"
#endif
#define GROUP_BYTES (CODE_BYTES + 32)
#ifndef ROW_TILE
#define ROW_TILE 4 /* activation rows sharing each unpacked block of a group */
#endif
#define GROUP_CHUNK 4   /* groups per OpenMP work item (32 output rows) */
#define QUANTIZE_ROWS 8 /* rows at which quantizing goes parallel */

typedef struct {
    const int8_t *q;  /* [rows, k] codes */
    const float *d;   /* [rows, k / BLOCK] scales */
    const float *s;   /* [rows, k / BLOCK] scale times the block's sum of codes */
    int64_t k;
} quantized_rows;

/* one block of x (times input_scale) -> 32 int8 codes, their scale and their sum */
static inline void quantize_block(const float *x, const float *input_scale, int8_t *q, float *d, float *s) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        if (input_scale) v[i] = _mm256_mul_ps(v[i], _mm256_loadu_ps(input_scale + 8 * i));
    }
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 peak = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
    p4 = _mm_max_ss(p4, _mm_movehdup_ps(p4));
    const float top = _mm_cvtss_f32(p4);
    const float scale = top / 127.0f;
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i c[4];
    for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse)); /* to nearest even */
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
    /* |codes| <= 127: packing saturates nothing; the permute undoes the packs' lane order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d = scale;
    *s = scale * (float)_mm_cvtsi128_si32(t4);
}

#if CODE_BITS == 5
/* 32 bits -> 32 bytes, byte b 16 where bit b is set, else 0 */
static inline __m256i fifth_bits(const uint8_t *plane) {
    uint32_t bits;
    memcpy(&bits, plane, sizeof bits);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(16));
#else /* byte b takes bits' byte b / 8, then is all ones iff its bit b % 8 was set */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
#endif
}
#endif

static inline __m256i quad(const int8_t *a, int t) { /* activations 4t..4t+3, in every lane */
    int32_t v;
    memcpy(&v, a + 4 * t, sizeof v);
    return _mm256_set1_epi32(v);
}

/* the 8 rows' exact dots with one block of activations: lane j is row j's. Four partial
 * sums, added at the end, so that no instruction waits on the one before it (the sums
 * are exact, so their order changes nothing). */
static inline __m256i group_dot(const __m256i codes[8], const int8_t *a) {
    __m256i part[4];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    for (int t = 0; t < 4; t++) part[t] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes[t], quad(a, t));
    for (int t = 0; t < 4; t++) part[t] = _mm256_dpbusd_epi32(part[t], codes[t + 4], quad(a, t + 4));
    return _mm256_add_epi32(_mm256_add_epi32(part[0], part[1]), _mm256_add_epi32(part[2], part[3]));
#else
    for (int t = 0; t < 4; t++)
        part[t] = _mm256_add_epi16(_mm256_maddubs_epi16(codes[t], quad(a, t)),
                                   _mm256_maddubs_epi16(codes[t + 4], quad(a, t + 4)));
#if CODE_BITS == 4 /* code <= 15, |a| <= 127: a pair is <= 3810 and 8 pairs' sums stay below 2^15 */
    const __m256i pairs = _mm256_add_epi16(_mm256_add_epi16(part[0], part[1]), _mm256_add_epi16(part[2], part[3]));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else /* code <= 31: 2 pairs' sums (<= 15748) are all int16 holds */
    const __m256i one = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(part[0], one), _mm256_madd_epi16(part[1], one)),
                            _mm256_add_epi32(_mm256_madd_epi16(part[2], one), _mm256_madd_epi16(part[3], one)));
#endif
#endif
}

/* `mt` activation rows from m0 times one group of 8 weight rows (the first `valid` real) */
static inline __attribute__((always_inline)) void tile(quantized_rows x, const uint8_t *group, int64_t m0,
                                                        int mt, float *out, int64_t n, int64_t n0, int valid) {
    const int64_t blocks = x.k / BLOCK;
    __m256 acc[ROW_TILE], acc_min[ROW_TILE];
    for (int i = 0; i < mt; i++) acc[i] = acc_min[i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = group + b * GROUP_BYTES;
        __m256i codes[8];
        for (int c = 0; c < 4; c++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(p + 32 * c));
            codes[c] = _mm256_and_si256(packed, low);
            codes[c + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
#if CODE_BITS == 5
        for (int t = 0; t < 8; t++) codes[t] = _mm256_or_si256(codes[t], fifth_bits(p + 128 + 4 * t));
#endif
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + CODE_BYTES)));
        const __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + CODE_BYTES + 16)));
        for (int i = 0; i < mt; i++) {
            const int64_t m = m0 + i;
            const __m256i dot = group_dot(codes, x.q + m * x.k + b * BLOCK);
            const __m256 both = _mm256_mul_ps(scale, _mm256_set1_ps(x.d[m * blocks + b]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), both, acc[i]);
            acc_min[i] = _mm256_fmadd_ps(min, _mm256_set1_ps(x.s[m * blocks + b]), acc_min[i]);
        }
    }
    for (int i = 0; i < mt; i++) {
        acc[i] = _mm256_add_ps(acc[i], acc_min[i]);
        float *row = out + (m0 + i) * n + n0;
        if (valid == GROUP) {
            _mm256_storeu_ps(row, acc[i]);
        } else {
            float lane[GROUP];
            _mm256_storeu_ps(lane, acc[i]);
            memcpy(row, lane, (size_t)valid * sizeof(float));
        }
    }
}

static void group_rows(quantized_rows x, int64_t rows, const uint8_t *group, float *out, int64_t n,
                       int64_t n0, int valid) {
    int64_t m0 = 0;
    for (; m0 + ROW_TILE <= rows; m0 += ROW_TILE) tile(x, group, m0, ROW_TILE, out, n, n0, valid);
    for (; m0 < rows; m0++) tile(x, group, m0, 1, out, n, n0, valid);
}

/* 0 on success, 1 where k is not a multiple of BLOCK, 2 where the scratch could not be had */
int llmq_lowbit_rows(const float *x, int64_t rows, int64_t k, const float *input_scale, const uint8_t *packed,
                   int64_t n, int threads, float *out) {
    if (k % BLOCK != 0) return 1;
    const int64_t blocks = k / BLOCK;
    int8_t *q = malloc((size_t)(rows * k) + 2 * sizeof(float) * (size_t)(rows * blocks));
    if (!q) return 2;
    float *d = (float *)(q + rows * k), *s = d + rows * blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= QUANTIZE_ROWS)
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < blocks; b++)
            quantize_block(x + m * k + b * BLOCK, input_scale ? input_scale + b * BLOCK : NULL,
                           q + m * k + b * BLOCK, d + m * blocks + b, s + m * blocks + b);
    const quantized_rows quantized = {q, d, s, k};
    const int64_t groups = (n + GROUP - 1) / GROUP;
    const int64_t chunks = (groups + GROUP_CHUNK - 1) / GROUP_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t g = c * GROUP_CHUNK; g < groups && g < (c + 1) * GROUP_CHUNK; g++) {
            const int64_t n0 = g * GROUP;
            const int valid = n - n0 < GROUP ? (int)(n - n0) : GROUP;
            group_rows(quantized, rows, packed + g * blocks * GROUP_BYTES, out, n, n0, valid);
        }
    }
    free(q);
    return 0;
}
