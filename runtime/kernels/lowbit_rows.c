/* A product with 4- and 5-bit weights (GGUF Q4_0, Q4_1, Q4_K; Q5_0, Q5_1) as integer dot
 * products, one fixed order of arithmetic per output.
 *
 * Why: torch's int4 kernel takes bf16 activations and widens every weight to floats for
 * every row it is given; on a 2-core AVX512-BF16 EPYC all 210 SmolLM2 layer products took
 * 4.5 ms at one row and 44 ms at 32. Here, as llama.cpp multiplies Q4_1 by Q8_1, each
 * activation row is rounded to int8 per block of 32 with a float32 scale, and a weight's
 * codes (unsigned, 0..15 or 0..31) meet those int8s in one integer dot instruction (VNNI's
 * vpdpbusd, else vpmaddubsw + vpmaddwd: the same exact int32s).
 *
 * Weights are packed by runtime/kernels/native.py `pack_lowbit` in groups of 16 rows, so
 * that lane j of every vector is output row j of the group and one block's dot of a whole
 * group is 8 instructions with no horizontal sums (the idea of llama.cpp's x86 "repack"
 * kernels, written here for the per-row float scale and min of GGUF's 4- and 5-bit types).
 * With AVX-512 one 512-bit vector holds the 16 rows; on AVX2 two 256-bit halves of 8 do,
 * each lane doing the same operations, so both give the same numbers:
 *
 *   per group g, per block b of 32 columns, GROUP_BYTES bytes:
 *   [0, 256)   codes: byte c * 64 + j * 4 + i holds row j's code 4c + i in its low nibble
 *              and code 16 + 4c + i in its high one (c in 0..3, j in 0..15, i in 0..3)
 *   CODE_BITS=5 only (GGUF Q5_0, Q5_1): [256, 320) fifth bits: bit j * 4 + i of the
 *              little-endian uint64 at 256 + 8t is bit 4 of row j's code 4t + i
 *   then 32 bytes of the 16 rows' scales and 32 of their mins, IEEE half
 *   (weight = code * scale + min)
 *
 * Built with -DCODE_BITS=8 (int8 per row with one float32 scale a row: the LM head of
 * runtime/kernels/torch_backend.py `Int8GroupWeight`; needs VNNI), a block is 512 bytes:
 * byte t * 64 + j * 4 + i is row j's code 4t + i plus 128; after a group's blocks come its
 * 16 row scales, float32. Then out[m, n] = scale[n] * sum over b of
 * (dot_b(codes[n] + 128, xq[m]) - 128 * sum_b(xq[m])) * xs[m, b], the parenthesis exact.
 *
 * out[m, n] = D + M, where D sums dot_b(codes[n], xq[m]) * (scale[n, b] * xs[m, b]) and M
 * sums min[n, b] * (xs[m, b] * sum_b(xq[m])) over blocks b in block order, each block's dot
 * exact (int32) and one float32 fma per term. Tiles decide only which rows share a loaded
 * block, never an output's arithmetic, and a row is quantized alone: a row's result does
 * not depend on how many rows there are or how the threads split them
 * (runtime/kernels/int8_rows.c and paged_attention.c hold to the same rule).
 *
 * x            [rows, k] float32, C-contiguous, k a multiple of 32
 * norm_eps     >= 0: each row of x is first RMS-normalized, x * (1 / sqrt(mean(x^2) + eps)),
 *              its sum of squares in one fixed order (8 lanes over k, then a fixed tree);
 *              < 0: x as given
 * input_scale  [k] float32 multiplied into x (after the norm) first (a preceding RMSNorm's
 *              weight), or NULL
 * packed       [n_pad / 16, k / 32, GROUP_BYTES] uint8, n_pad = n rounded up to 16 (with
 *              -DCODE_BITS=8, [n_pad / 16, k / 32 * 512 + 64])
 * out          [rows, n] float32
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "lowbit_rows.c needs AVX2, FMA and F16C (every CPU llmq runs on has them)"
#endif

#define BLOCK 32
#define GROUP 16
#ifndef CODE_BITS
#define CODE_BITS 4
#endif
#if CODE_BITS == 4
#define CODE_BYTES 256
#define GROUP_BYTES (CODE_BYTES + 64)
#define GROUP_TAIL 0
#elif CODE_BITS == 5
#define CODE_BYTES 320
#define GROUP_BYTES (CODE_BYTES + 64)
#define GROUP_TAIL 0
#elif CODE_BITS == 8
#define GROUP_BYTES 512
#define GROUP_TAIL 64 /* the 16 rows' float32 scales, after the group's blocks */
#else
#error "CODE_BITS is 4, 5 or 8"
#endif
#ifndef ROW_TILE
#define ROW_TILE 4 /* activation rows sharing each unpacked block of a group */
#endif
#define GROUP_CHUNK 2   /* groups per OpenMP work item (32 output rows) */
#define QUANTIZE_ROWS 8 /* rows at which quantizing goes parallel */

/* The vector of LANES rows: a whole group with AVX-512, half of one on AVX2. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
typedef __m512i ivec;
typedef __m512 fvec;
typedef uint64_t plane_t;
#define load_codes(p) _mm512_loadu_si512((const void *)(p))
#define set1_i8 _mm512_set1_epi8
#define set1_i16 _mm512_set1_epi16
#define set1_i32 _mm512_set1_epi32
#define and_i _mm512_and_si512
#define srli_i16 _mm512_srli_epi16
#define or_i _mm512_or_si512
#define add_i16 _mm512_add_epi16
#define add_i32 _mm512_add_epi32
#define sub_i32 _mm512_sub_epi32
#define load_f _mm512_loadu_ps
#define maddubs _mm512_maddubs_epi16
#define madd _mm512_madd_epi16
#define zero_i _mm512_setzero_si512
#define halves(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define cvt_f _mm512_cvtepi32_ps
#define mul_f _mm512_mul_ps
#define fma_f _mm512_fmadd_ps
#define add_f _mm512_add_ps
#define set1_f _mm512_set1_ps
#define zero_f _mm512_setzero_ps
#define store_f _mm512_storeu_ps
#define fifth_bits(bits) _mm512_maskz_mov_epi8((__mmask64)(bits), _mm512_set1_epi8(16))
#if defined(__AVX512VNNI__)
#define DPBUSD _mm512_dpbusd_epi32
#endif
#else
#define LANES 8
typedef __m256i ivec;
typedef __m256 fvec;
typedef uint32_t plane_t;
#define load_codes(p) _mm256_loadu_si256((const __m256i *)(p))
#define set1_i8 _mm256_set1_epi8
#define set1_i16 _mm256_set1_epi16
#define set1_i32 _mm256_set1_epi32
#define and_i _mm256_and_si256
#define srli_i16 _mm256_srli_epi16
#define or_i _mm256_or_si256
#define add_i16 _mm256_add_epi16
#define add_i32 _mm256_add_epi32
#define sub_i32 _mm256_sub_epi32
#define load_f _mm256_loadu_ps
#define maddubs _mm256_maddubs_epi16
#define madd _mm256_madd_epi16
#define zero_i _mm256_setzero_si256
#define halves(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define cvt_f _mm256_cvtepi32_ps
#define mul_f _mm256_mul_ps
#define fma_f _mm256_fmadd_ps
#define add_f _mm256_add_ps
#define set1_f _mm256_set1_ps
#define zero_f _mm256_setzero_ps
#define store_f _mm256_storeu_ps
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define DPBUSD _mm256_dpbusd_avx_epi32
#endif
/* 32 bits -> 32 bytes, byte b 16 where bit b is set, else 0 */
static inline __m256i fifth_bits(uint32_t bits) {
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
#define HALVES (GROUP / LANES) /* vectors per group: 1 with AVX-512, 2 on AVX2 */
#if CODE_BITS == 8 && !defined(DPBUSD)
#error "8-bit codes need VNNI's vpdpbusd (vpmaddubsw saturates at 255 x 127 x 2)"
#endif

typedef struct {
    const int8_t *q;      /* [rows, k] codes */
    const float *d;       /* [rows, k / BLOCK] scales */
    const float *s;       /* [rows, k / BLOCK] scale times the block's sum of codes */
    const int32_t *sum;   /* [rows, k / BLOCK] the block's sum of codes */
    int64_t k;
} quantized_rows;

/* one block of x (times norm, then input_scale) -> 32 int8 codes, their scale and their sum */
static inline void quantize_block(const float *x, float norm, const float *input_scale, int8_t *q, float *d,
                                  float *s, int32_t *sum) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(norm)); /* exact where norm is 1 */
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
    *sum = _mm_cvtsi128_si32(t4);
    *s = scale * (float)*sum;
}

/* 1 / sqrt(mean(x^2) + eps) of one row of k (a multiple of 32) values, as
 * runtime/models/base.py `rms_normalize` computes it, the squares summed in 8 lanes over k
 * and the lanes in one fixed tree: the same for a row whatever else is in the call */
static inline float rms_inverse(const float *x, int64_t k, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    const float total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    return 1.0f / sqrtf(total / (float)k + eps);
}

static inline ivec quad(const int8_t *a, int t) { /* activations 4t..4t+3, in every lane */
    int32_t v;
    memcpy(&v, a + 4 * t, sizeof v);
    return set1_i32(v);
}

/* the LANES rows' exact dots with one block of activations: lane j is row j's. Four partial
 * sums, added at the end, so that no instruction waits on the one before it (the sums are
 * exact, so their order changes nothing). */
static inline ivec group_dot(const ivec codes[8], const int8_t *a) {
    ivec part[4];
#ifdef DPBUSD
    for (int t = 0; t < 4; t++) part[t] = DPBUSD(zero_i(), codes[t], quad(a, t));
    for (int t = 0; t < 4; t++) part[t] = DPBUSD(part[t], codes[t + 4], quad(a, t + 4));
    return add_i32(add_i32(part[0], part[1]), add_i32(part[2], part[3]));
#else
    for (int t = 0; t < 4; t++)
        part[t] = add_i16(maddubs(codes[t], quad(a, t)), maddubs(codes[t + 4], quad(a, t + 4)));
#if CODE_BITS == 4 /* code <= 15, |a| <= 127: a pair is <= 3810 and 8 pairs' sums stay below 2^15 */
    return madd(add_i16(add_i16(part[0], part[1]), add_i16(part[2], part[3])), set1_i16(1));
#else /* code <= 31: 2 pairs' sums (<= 15748) are all int16 holds */
    const ivec one = set1_i16(1);
    return add_i32(add_i32(madd(part[0], one), madd(part[1], one)), add_i32(madd(part[2], one), madd(part[3], one)));
#endif
#endif
}

/* `mt` activation rows from m0 times lanes [h * LANES, (h + 1) * LANES) of one group, whose
 * output rows start at n0 (`valid` of them real) */
static inline __attribute__((always_inline)) void tile(quantized_rows x, const uint8_t *group, int h, int64_t m0,
                                                        int mt, float *out, int64_t n, int64_t n0, int valid) {
    const int64_t blocks = x.k / BLOCK;
    fvec acc[ROW_TILE], acc_min[ROW_TILE];
    for (int i = 0; i < mt; i++) acc[i] = acc_min[i] = zero_f();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = group + b * GROUP_BYTES;
        ivec codes[8];
#if CODE_BITS == 8 /* the codes as stored: step t's 4 bytes of every row side by side */
        for (int t = 0; t < 8; t++) codes[t] = load_codes(p + 64 * t + 4 * LANES * h);
        for (int i = 0; i < mt; i++) {
            const int64_t m = m0 + i;
            /* stored codes are the signed ones plus 128: take 128 times the activations' sum
             * back, exactly, in int32 */
            const ivec dot = sub_i32(group_dot(codes, x.q + m * x.k + b * BLOCK),
                                     set1_i32(128 * x.sum[m * blocks + b]));
            acc[i] = fma_f(cvt_f(dot), set1_f(x.d[m * blocks + b]), acc[i]);
        }
#else
        const ivec low = set1_i8(0x0f);
        for (int c = 0; c < 4; c++) {
            const ivec packed = load_codes(p + 64 * c + 4 * LANES * h);
            codes[c] = and_i(packed, low);
            codes[c + 4] = and_i(srli_i16(packed, 4), low);
        }
#if CODE_BITS == 5
        for (int t = 0; t < 8; t++) {
            plane_t bits;
            memcpy(&bits, p + 256 + 8 * t + sizeof(plane_t) * h, sizeof bits);
            codes[t] = or_i(codes[t], fifth_bits(bits));
        }
#endif
        const fvec scale = halves(p + CODE_BYTES + 2 * LANES * h);
        const fvec min = halves(p + CODE_BYTES + 32 + 2 * LANES * h);
        for (int i = 0; i < mt; i++) {
            const int64_t m = m0 + i;
            const ivec dot = group_dot(codes, x.q + m * x.k + b * BLOCK);
            const fvec both = mul_f(scale, set1_f(x.d[m * blocks + b]));
            acc[i] = fma_f(cvt_f(dot), both, acc[i]);
            acc_min[i] = fma_f(min, set1_f(x.s[m * blocks + b]), acc_min[i]);
        }
#endif
    }
    const int first = h * LANES, count = valid - first < LANES ? valid - first : LANES;
#if CODE_BITS == 8
    const fvec row_scale = load_f((const float *)(group + blocks * GROUP_BYTES) + first);
#endif
    for (int i = 0; i < mt; i++) {
#if CODE_BITS == 8
        acc[i] = mul_f(acc[i], row_scale);
#else
        acc[i] = add_f(acc[i], acc_min[i]);
#endif
        float *row = out + (m0 + i) * n + n0 + first;
        if (count == LANES) {
            store_f(row, acc[i]);
        } else if (count > 0) {
            float lane[LANES];
            store_f(lane, acc[i]);
            memcpy(row, lane, (size_t)count * sizeof(float));
        }
    }
}

static void group_rows(quantized_rows x, int64_t rows, const uint8_t *group, float *out, int64_t n, int64_t n0,
                       int valid) {
    for (int h = 0; h < HALVES; h++) {
        if (h * LANES >= valid) break;
        int64_t m0 = 0;
        for (; m0 + ROW_TILE <= rows; m0 += ROW_TILE) tile(x, group, h, m0, ROW_TILE, out, n, n0, valid);
        for (; m0 < rows; m0++) tile(x, group, h, m0, 1, out, n, n0, valid);
    }
}

/* 0 on success, 1 where k is not a multiple of BLOCK, 2 where the scratch could not be had */
int llmq_lowbit_rows(const float *x, int64_t rows, int64_t k, float norm_eps, const float *input_scale,
                     const uint8_t *packed, int64_t n, int threads, float *out) {
    if (k % BLOCK != 0) return 1;
    const int64_t blocks = k / BLOCK;
    int8_t *q = malloc((size_t)(rows * k) + 3 * sizeof(float) * (size_t)(rows * blocks));
    if (!q) return 2;
    float *d = (float *)(q + rows * k), *s = d + rows * blocks;
    int32_t *sum = (int32_t *)(s + rows * blocks);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= QUANTIZE_ROWS)
    for (int64_t m = 0; m < rows; m++) {
        const float norm = norm_eps >= 0.0f ? rms_inverse(x + m * k, k, norm_eps) : 1.0f;
        for (int64_t b = 0; b < blocks; b++)
            quantize_block(x + m * k + b * BLOCK, norm, input_scale ? input_scale + b * BLOCK : NULL,
                           q + m * k + b * BLOCK, d + m * blocks + b, s + m * blocks + b,
                           sum + m * blocks + b);
    }
    const quantized_rows quantized = {q, d, s, sum, k};
    const int64_t groups = (n + GROUP - 1) / GROUP;
    const int64_t chunks = (groups + GROUP_CHUNK - 1) / GROUP_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t g = c * GROUP_CHUNK; g < groups && g < (c + 1) * GROUP_CHUNK; g++) {
            const int64_t n0 = g * GROUP;
            const int valid = n - n0 < GROUP ? (int)(n - n0) : GROUP;
            group_rows(quantized, rows, packed + g * (blocks * GROUP_BYTES + GROUP_TAIL), out, n, n0, valid);
        }
    }
    free(q);
    return 0;
}
