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
 *
 * `llmq_int8_blocks` multiplies a file's own 8-bit codes with a float32 scale per block of
 * 32 (GGUF Q8_0) or per half block of 16 (Q6_K's codes minus 32, each sub-block's scale
 * times the super-block's), as llama.cpp's AVX2 Q8_0 x Q8_0 dot does: the same exact
 * block dots, whose lanes 0-3 hold columns 0-15 of the block and lanes 4-7 columns 16-31,
 * each lane times its half's weight scale and the row's block scale in one float32 fma,
 * in block order; no row scale. A code of -128 (never written by llama.cpp's quantizers)
 * would be read as +128 against negative activations, as llama.cpp's own sign trick does.
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

/* 32 values -> int8 codes, their magnitudes and their scale (peak / 127); the values minus
 * what the codes hold go to `residual`, if given */
static void quantize_block(const float *v, int8_t *q, uint8_t *q_abs, float *block_scale, float *residual) {
    float peak = 0.0f;
    for (int i = 0; i < BLOCK; i++) peak = fabsf(v[i]) > peak ? fabsf(v[i]) : peak;
    const float scale = peak / 127.0f, inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
    *block_scale = scale;
    for (int i = 0; i < BLOCK; i++) {
        const int code = (int)nearbyintf(v[i] * inverse);
        q[i] = (int8_t)code;
        q_abs[i] = (uint8_t)(code < 0 ? -code : code);
        if (residual) residual[i] = v[i] - scale * (float)code;
    }
}

/* row x (times input_scale [k] first, if given) -> int8 codes q, their magnitudes |q|, and
 * one scale per block of 32; with `fine` (q2, q2_abs, scale2), what those codes miss is
 * rounded the same way a second time (~15 bits of each block where one pass keeps ~8) */
static void quantize_row(const float *x, const float *input_scale, int64_t k, int8_t *q, uint8_t *q_abs,
                         float *block_scale, int8_t *q2, uint8_t *q2_abs, float *scale2) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        float v[BLOCK], residual[BLOCK];
        for (int i = 0; i < BLOCK; i++)
            v[i] = input_scale ? x[b * BLOCK + i] * input_scale[b * BLOCK + i] : x[b * BLOCK + i];
        quantize_block(v, q + b * BLOCK, q_abs + b * BLOCK, block_scale + b, q2 ? residual : NULL);
        if (q2) quantize_block(residual, q2 + b * BLOCK, q2_abs + b * BLOCK, scale2 + b, NULL);
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
    const int8_t *q2;     /* the second pass's codes (`quantize_row`), or NULL */
    const uint8_t *q2_abs;
    const float *scale2;
} quantized_rows;

/* a weight's scales per block (llmq_int8_blocks): `per_block` (1 or 2) float32 per 32 */
typedef struct {
    const float *scale; /* [n, k / BLOCK * per_block], or NULL: one scale per row */
    int64_t per_block;
} block_scales;

/* lanes 0-3 times the block's first half's weight scale, 4-7 its second's, all times xs */
static inline __m256 both_scales(block_scales w, int64_t row, int64_t blocks, int64_t b, __m256 xs) {
    const float *s = w.scale + (row * blocks + b) * w.per_block;
    return _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(s[w.per_block - 1]), _mm_set1_ps(s[0])), xs);
}

/* `mt` activation rows times `nt` weight rows; always inlined with constant tile sizes, so
 * the accumulators stay in registers */
static inline __attribute__((always_inline)) void tile(quantized_rows x, int64_t k,
                                                        const int8_t *codes, const float *scales,
                                                        block_scales ws, int64_t n, int64_t m0,
                                                        int mt, int64_t n0, int nt, float *out) {
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
                const __m256 scale = ws.scale ? both_scales(ws, n0 + j, blocks, b, xs[i]) : xs[i];
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i][j]);
                if (x.q2) { /* the second pass's block, added right after the first's */
                    const int64_t at = (m0 + i) * k + b * BLOCK;
                    const __m256i q2 = _mm256_loadu_si256((const __m256i *)(x.q2 + at));
                    const __m256i a2 = _mm256_loadu_si256((const __m256i *)(x.q2_abs + at));
                    const __m256 s2 = _mm256_set1_ps(x.scale2[(m0 + i) * blocks + b]);
                    const __m256i dot2 = block_dot(a2, _mm256_sign_epi8(w, q2));
                    const __m256 scale2 = ws.scale ? both_scales(ws, n0 + j, blocks, b, s2) : s2;
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2), scale2, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++)
            out[(m0 + i) * n + n0 + j] = finish(acc[i][j], ws.scale ? 1.0f : scales[n0 + j]);
}

static void weight_rows(quantized_rows x, int64_t rows, int64_t k, const int8_t *codes,
                        const float *scales, block_scales ws, int64_t n, int64_t first, int64_t end,
                        float *out) {
    int64_t n0 = first;
    for (; n0 + WEIGHT_TILE <= end; n0 += WEIGHT_TILE) {
        int64_t m0 = 0;
        for (; m0 + ROW_TILE <= rows; m0 += ROW_TILE)
            tile(x, k, codes, scales, ws, n, m0, ROW_TILE, n0, WEIGHT_TILE, out);
        for (; m0 < rows; m0++) tile(x, k, codes, scales, ws, n, m0, 1, n0, WEIGHT_TILE, out);
    }
    for (; n0 < end; n0++) {
        int64_t m0 = 0;
        for (; m0 + ROW_TILE <= rows; m0 += ROW_TILE)
            tile(x, k, codes, scales, ws, n, m0, ROW_TILE, n0, 1, out);
        for (; m0 < rows; m0++) tile(x, k, codes, scales, ws, n, m0, 1, n0, 1, out);
    }
}

/* work: the rows' codes, magnitudes and scales (rows * (2k + 4k / 32) bytes), twice with
 * `fine` */
static int product(const float *x, const float *input_scale, int fine, int64_t rows, int64_t k,
                   const int8_t *codes, const float *scales, block_scales ws, int64_t n, int threads,
                   void *work, float *out) {
    if (k % BLOCK != 0) return 1;
    int8_t *q = (int8_t *)work;
    uint8_t *q_abs = (uint8_t *)(q + rows * k);
    float *block_scale = (float *)(q_abs + rows * k);
    int8_t *q2 = fine ? (int8_t *)(block_scale + rows * (k / BLOCK)) : NULL;
    uint8_t *q2_abs = fine ? (uint8_t *)(q2 + rows * k) : NULL;
    float *scale2 = fine ? (float *)(q2_abs + rows * k) : NULL;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int64_t m = 0; m < rows; m++) {
        const int64_t at = m * k, bt = m * (k / BLOCK);
        quantize_row(x + at, input_scale, k, q + at, q_abs + at, block_scale + bt, fine ? q2 + at : NULL,
                     fine ? q2_abs + at : NULL, fine ? scale2 + bt : NULL);
    }
    const quantized_rows quantized = {q, q_abs, block_scale, q2, q2_abs, scale2};
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t first = c * CHUNK, end = first + CHUNK < n ? first + CHUNK : n;
        weight_rows(quantized, rows, k, codes, scales, ws, n, first, end, out);
    }
    return 0;
}

/* 0 on success, 1 where k is not a multiple of BLOCK (nothing is written) */
int llmq_int8_rows(const float *x, int64_t rows, int64_t k, const int8_t *codes,
                   const float *scales, int64_t n, int threads, void *work, float *out) {
    const block_scales none = {NULL, 1};
    return product(x, NULL, 0, rows, k, codes, scales, none, n, threads, work, out);
}

/* the same over a file's own codes: `weight_scales` [n, k / 32 * per_block] float32
 * (per_block 1: Q8_0's scale per 32; 2: a scale per 16), x times `input_scale` [k] (or
 * NULL) before it is rounded, in two passes with `fine` (work twice as large); 2 where
 * per_block is neither */
int llmq_int8_blocks(const float *x, const float *input_scale, int fine, int64_t rows, int64_t k,
                     const int8_t *codes, const float *weight_scales, int64_t per_block, int64_t n,
                     int threads, void *work, float *out) {
    if (per_block != 1 && per_block != 2) return 2;
    const block_scales ws = {weight_scales, per_block};
    return product(x, input_scale, fine, rows, k, codes, NULL, ws, n, threads, work, out);
}
