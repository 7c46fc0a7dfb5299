/* A product with int8-per-row weights as integer dot products, one fixed order per output.
 *
 * Why: the LM head is the largest single product of a decode step (SmolLM2's: 49152 rows
 * of 576, 28 MB as int8), and torch's `_weight_int8pack_mm` widens every weight for every
 * row it is given (2 ms for that head at one row on a 2-core AVX512-BF16 EPYC, 25 ms at
 * 32). Here, as llama.cpp multiplies its Q8_0 head, each activation row is rounded to int8
 * per block of 32 with a float32 scale, and 32 weights at a time go through one integer
 * dot instruction (VNNI's vpdpbusd, else AVX2's vpmaddubsw + vpmaddwd: the same exact
 * int32s). Simulated on SmolLM2 first, teacher-forced top-1 rose from 96.2% to 96.8%
 * against llama.cpp and from 97.1% to 98.0% against the float32 reference: blocks of 32
 * hold the activations' outliers better than bf16 rounding of each one did.
 *
 * out[m, n] = scale[n] * sum over blocks b of xs[m, b] * dot_b(xq[m], codes[n]): each
 * block's dot is exact (int32); lane l of one 8-wide float32 accumulator adds block b's
 * lane l times xs[m, b] in block order; the lanes are added in one fixed tree, then the
 * scale. Tiles only decide which accumulators live at once, never an output's arithmetic,
 * and a row is quantized alone: a row's result does not depend on how many rows there are
 * (runtime/kernels/paged_attention.c holds attention to the same rule). See
 * runtime/kernels/native.py for the build.
 *
 * x      [rows, k] float32, C-contiguous, k a multiple of 32
 * codes  [n, k] int8, C-contiguous
 * scales [n] float32
 * work   rows * (2 * k + 4 * k / 32) bytes of scratch (the quantized rows)
 * out    [rows, n] float32
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "int8_rows.c needs AVX2 and FMA (every CPU llmq runs on has them)"
#endif

#define BLOCK 32
#define ROW_TILE 2    /* activation rows sharing each loaded weight block */
#define WEIGHT_TILE 4 /* weight rows sharing each quantized activation block */
#define CHUNK 16      /* weight rows per OpenMP work item */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16
#endif

/* the 8 int32 partial sums of a block: lane l holds 4 adjacent products (exact) */
static inline __m256i block_dot(__m256i x_abs, __m256i signed_w) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), x_abs, signed_w);
#else /* |x|, |w| <= 127: a pair of products stays below 2^15, so no saturation */
    const __m256i pairs = _mm256_maddubs_epi16(x_abs, signed_w);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* row x -> int8 codes q, their magnitudes |q|, and one scale per block of 32 */
static void quantize_row(const float *x, int64_t k, int8_t *q, uint8_t *q_abs, float *block_scale) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const float *v = x + b * BLOCK;
        float peak = 0.0f;
        for (int i = 0; i < BLOCK; i++) peak = fabsf(v[i]) > peak ? fabsf(v[i]) : peak;
        const float scale = peak / 127.0f, inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
        block_scale[b] = scale;
        for (int i = 0; i < BLOCK; i++) {
            const int code = (int)nearbyintf(v[i] * inverse);
            q[b * BLOCK + i] = (int8_t)code;
            q_abs[b * BLOCK + i] = (uint8_t)(code < 0 ? -code : code);
        }
    }
}

static inline float finish(__m256 acc, float scale) {
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    return (((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))) * scale;
}

typedef struct {
    const int8_t *q;      /* [rows, k] */
    const uint8_t *q_abs; /* [rows, k] */
    const float *scale;   /* [rows, k / BLOCK] */
} quantized_rows;

/* `mt` activation rows times `nt` weight rows; always inlined with constant tile sizes, so
 * the accumulators stay in registers */
static inline __attribute__((always_inline)) void tile(quantized_rows x, int64_t k,
                                                        const int8_t *codes, const float *scales,
                                                        int64_t n, int64_t m0, int mt,
                                                        int64_t n0, int nt, float *out) {
    __m256 acc[ROW_TILE][WEIGHT_TILE];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t blocks = k / BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        __m256i xq[ROW_TILE], xa[ROW_TILE];
        __m256 xs[ROW_TILE];
        for (int i = 0; i < mt; i++) {
            xq[i] = _mm256_loadu_si256((const __m256i *)(x.q + (m0 + i) * k + b * BLOCK));
            xa[i] = _mm256_loadu_si256((const __m256i *)(x.q_abs + (m0 + i) * k + b * BLOCK));
            xs[i] = _mm256_set1_ps(x.scale[(m0 + i) * blocks + b]);
        }
        for (int j = 0; j < nt; j++) {
            _mm_prefetch((const char *)(codes + (n0 + j + PREFETCH_ROWS) * k + b * BLOCK), _MM_HINT_T0);
            const __m256i w = _mm256_loadu_si256((const __m256i *)(codes + (n0 + j) * k + b * BLOCK));
            for (int i = 0; i < mt; i++) {
                const __m256i dot = block_dot(xa[i], _mm256_sign_epi8(w, xq[i]));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), xs[i], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) out[(m0 + i) * n + n0 + j] = finish(acc[i][j], scales[n0 + j]);
}

static void weight_rows(quantized_rows x, int64_t rows, int64_t k, const int8_t *codes,
                        const float *scales, int64_t n, int64_t first, int64_t end, float *out) {
    int64_t n0 = first;
    for (; n0 + WEIGHT_TILE <= end; n0 += WEIGHT_TILE) {
        int64_t m0 = 0;
        for (; m0 + ROW_TILE <= rows; m0 += ROW_TILE)
            tile(x, k, codes, scales, n, m0, ROW_TILE, n0, WEIGHT_TILE, out);
        for (; m0 < rows; m0++) tile(x, k, codes, scales, n, m0, 1, n0, WEIGHT_TILE, out);
    }
    for (; n0 < end; n0++) {
        int64_t m0 = 0;
        for (; m0 + ROW_TILE <= rows; m0 += ROW_TILE)
            tile(x, k, codes, scales, n, m0, ROW_TILE, n0, 1, out);
        for (; m0 < rows; m0++) tile(x, k, codes, scales, n, m0, 1, n0, 1, out);
    }
}

/* 0 on success, 1 where k is not a multiple of BLOCK (nothing is written) */
int llmq_int8_rows(const float *x, int64_t rows, int64_t k, const int8_t *codes,
                   const float *scales, int64_t n, int threads, void *work, float *out) {
    if (k % BLOCK != 0) return 1;
    int8_t *q = (int8_t *)work;
    uint8_t *q_abs = (uint8_t *)(q + rows * k);
    float *block_scale = (float *)(q_abs + rows * k);
    for (int64_t m = 0; m < rows; m++)
        quantize_row(x + m * k, k, q + m * k, q_abs + m * k, block_scale + m * (k / BLOCK));
    const quantized_rows quantized = {q, q_abs, block_scale};
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t first = c * CHUNK, end = first + CHUNK < n ? first + CHUNK : n;
        weight_rows(quantized, rows, k, codes, scales, n, first, end, out);
    }
    return 0;
}
