/* Products with float weights in one fixed order of arithmetic per output row: the fp16
 * weights a file holds as F16/BF16/F32 (and the types no integer kernel takes), and LoRA
 * deltas (runtime/lora.py `RowAdapters`).
 *
 * Why: fbgemm's fp16 gemm and numpy's BLAS block their sums by how many rows they are
 * given, so a row's result moved in its last bits with the rows beside it (~1e-4 in the
 * logits on an AVX2 EPYC, bench/invariance.py), and a greedy request with a LoRA adapter
 * answered differently alone and in a batch there. Here each output is one row's own sum:
 * 8 float32 lanes over k in order (lane l takes columns l, l + 8, ...), the lanes added in
 * one fixed tree, then any tail column by fma. Tiles decide only which rows share a load,
 * never an output's arithmetic (runtime/kernels/int8_rows.c and lowbit_rows.c hold to the
 * same rule). See runtime/kernels/native.py for the build.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "dense_rows.c needs AVX2, FMA and F16C (every CPU llmq runs on has them)"
#endif

#define ROW_TILE 4    /* activation rows sharing each loaded weight vector */
#define WEIGHT_TILE 2 /* weight rows sharing each loaded activation vector */
#define CHUNK 16      /* weight rows per OpenMP work item */
#define PARALLEL_ROWS 4

static inline float lanes_sum(__m256 acc) {
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* `mt` rows of x times `nt` fp16 weight rows from n0; k a multiple of 8 */
static inline __attribute__((always_inline)) void fp16_tile(const float *x, int64_t k, const uint16_t *w,
                                                             int64_t n, int64_t m0, int mt, int64_t n0, int nt,
                                                             float *out) {
    __m256 acc[ROW_TILE][WEIGHT_TILE];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c += 8) {
        __m256 wv[WEIGHT_TILE];
        for (int j = 0; j < nt; j++) wv[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + (n0 + j) * k + c)));
        for (int i = 0; i < mt; i++) {
            const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * k + c);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) out[(m0 + i) * n + n0 + j] = lanes_sum(acc[i][j]);
}

/* x [rows, k] float32 times w [n, k] IEEE half -> out [rows, n]; 1 where k is not a
 * multiple of 8 (nothing is written) */
int llmq_fp16_rows(const float *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, int threads, float *out) {
    if (k % 8 != 0) return 1;
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t end = (ch + 1) * CHUNK < n ? (ch + 1) * CHUNK : n;
        int64_t n0 = ch * CHUNK;
        for (; n0 + WEIGHT_TILE <= end; n0 += WEIGHT_TILE) {
            int64_t m0 = 0;
            for (; m0 + ROW_TILE <= rows; m0 += ROW_TILE) fp16_tile(x, k, w, n, m0, ROW_TILE, n0, WEIGHT_TILE, out);
            for (; m0 < rows; m0++) fp16_tile(x, k, w, n, m0, 1, n0, WEIGHT_TILE, out);
        }
        for (; n0 < end; n0++)
            for (int64_t m0 = 0; m0 < rows; m0++) fp16_tile(x, k, w, n, m0, 1, n0, 1, out);
    }
    return 0;
}

/* one row's dot with one float32 row of k values: 8 lanes, the fixed tree, then the tail */
static inline float dot_row(const float *x, const float *a, int64_t k) {
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= k; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(a + c), acc);
    float total = lanes_sum(acc);
    for (; c < k; c++) total = fmaf(x[c], a[c], total);
    return total;
}

/* For each of `count` rows m = index[i]: out[m] += ((x[m] . a[r]) * scale[i] for r) @ bt,
 * the low-rank product in rank order for every output column. x [*, k] and out [*, n]
 * float32, C-contiguous; a [rank, k]; bt [rank, n] (B transposed). 2 where the scratch
 * could not be had. */
int llmq_lora_rows(const float *x, int64_t k, const int64_t *index, const float *scale, int64_t count,
                   const float *a, int64_t rank, const float *bt, int64_t n, int threads, float *out) {
    float *low_all = malloc(sizeof(float) * (size_t)(count * rank + 1));
    if (!low_all) return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= PARALLEL_ROWS)
    for (int64_t i = 0; i < count; i++) {
        const int64_t m = index[i];
        float *low = low_all + i * rank;
        for (int64_t r = 0; r < rank; r++) low[r] = dot_row(x + m * k, a + r * k, k) * scale[i];
        float *row = out + m * n;
        int64_t c = 0;
        for (; c + 8 <= n; c += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t r = 0; r < rank; r++)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(low[r]), _mm256_loadu_ps(bt + r * n + c), acc);
            _mm256_storeu_ps(row + c, _mm256_add_ps(_mm256_loadu_ps(row + c), acc));
        }
        for (; c < n; c++) {
            float acc = 0.0f;
            for (int64_t r = 0; r < rank; r++) acc = fmaf(low[r], bt[r * n + c], acc);
            row[c] += acc;
        }
    }
    free(low_all);
    return 0;
}
