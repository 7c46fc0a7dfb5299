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
#include <string.h>

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

/* `llmq_int8_groups`: the same Q8_0 / Q6_K codes laid out 16 weight rows side by side
 * (runtime/kernels/native.py `pack_int8_groups`, lowbit_rows.c's 8-bit layout), so that
 * lane j of every vector is output row j and one block of an activation row meets a whole
 * group in 8 VNNI instructions, each activation block loaded once per 16 weight rows
 * instead of once per row, with no horizontal sums. With AVX-512 one 512-bit vector holds
 * the 16 rows; on AVX2 two 256-bit halves of 8 do, through llama.cpp's sign trick
 * (vpsignb, vpmaddubsw, vpmaddwd): the same exact int32s, the same float32 operations per
 * lane, so both builds give the same numbers.
 *
 * packed  [n_pad / 16, k / 32, 512] uint8: byte t * 64 + j * 4 + i of a block is row j's
 *         code 4t + i plus 128 (t in 0..7: columns 0-15 are steps 0-3, 16-31 steps 4-7)
 * scales  [n_pad / 16, k / 32, per_block, 16] float32: row j's scale of the block (Q8_0)
 *         or of each half of it (Q6_K)
 *
 * out[m, n] sums over blocks b in block order, one float32 fma per term: dot_b(codes[n],
 * xq[m]) * (scale[n, b] * xs[m, b]) (per_block 1), or each half's dot times its own scale,
 * first half first (per_block 2); each dot exact (int32); with `fine`, the second pass's
 * terms right after the first's, as in `tile`. A row is quantized alone and tiles decide
 * only which rows share a loaded block: a row's result does not depend on its batch. */

#define GROUP 16
#ifdef NIBBLE_TABLE
/* Built with -DNIBBLE_TABLE=1 (llama.cpp's kvalues_iq4nl: IQ4_NL, IQ4_XS), 2
 * (kvalues_mxfp4: MXFP4) or 3 (the nibble as a signed 4-bit number, -8..7: Q3_K's codes
 * -4..3, Q2_K's 0..3), a group's block holds 4-bit indices into that table: half the
 * bytes (native.py `pack_nibble_groups`). Byte c * 64 + j * 4 + i holds row j's index of
 * column 4c + i in its low nibble and of column 16 + 4c + i in its high one (steps c and
 * c + 4), and a shuffle through the table plus 128 gives exactly the codes + 128 the 8-bit
 * layout holds: the same int32 dots, the same float32 operations, the same numbers. */
#define GROUP_BYTES 256
#if NIBBLE_TABLE == 1
static const int8_t nibble_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#elif NIBBLE_TABLE == 2
static const int8_t nibble_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#elif NIBBLE_TABLE == 3
static const int8_t nibble_values[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
#else
#error "NIBBLE_TABLE is 1, 2 or 3"
#endif
#else
#define GROUP_BYTES 512
#endif
#ifndef GROUP_ROW_TILE
#define GROUP_ROW_TILE 4 /* activation rows sharing each loaded block of a group */
#endif
#define GROUP_CHUNK 2 /* groups per OpenMP work item */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LANES 16
typedef __m512i gvec;
typedef __m512 gfvec;
#define g_load(p) _mm512_loadu_si512((const void *)(p))
#define g_set1_i32 _mm512_set1_epi32
#define g_add_i32 _mm512_add_epi32
#define g_zero_i _mm512_setzero_si512
#define g_cvt _mm512_cvtepi32_ps
#define g_load_f _mm512_loadu_ps
#define g_mul _mm512_mul_ps
#define g_fma _mm512_fmadd_ps
#define g_set1_f _mm512_set1_ps
#define g_zero_f _mm512_setzero_ps
#define g_store_f _mm512_storeu_ps
#define GROUP_DPBUSD _mm512_dpbusd_epi32
#define g_table(t) _mm512_broadcast_i32x4(t)
#define g_shuffle _mm512_shuffle_epi8
#define g_and _mm512_and_si512
#define g_srli16 _mm512_srli_epi16
#define g_set1_i8 _mm512_set1_epi8
#else
#define LANES 8
#define g_table(t) _mm256_broadcastsi128_si256(t)
#define g_shuffle _mm256_shuffle_epi8
#define g_and _mm256_and_si256
#define g_srli16 _mm256_srli_epi16
#define g_set1_i8 _mm256_set1_epi8
typedef __m256i gvec;
typedef __m256 gfvec;
#define g_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define g_set1_i32 _mm256_set1_epi32
#define g_add_i32 _mm256_add_epi32
#define g_zero_i _mm256_setzero_si256
#define g_cvt _mm256_cvtepi32_ps
#define g_load_f _mm256_loadu_ps
#define g_mul _mm256_mul_ps
#define g_fma _mm256_fmadd_ps
#define g_set1_f _mm256_set1_ps
#define g_zero_f _mm256_setzero_ps
#define g_store_f _mm256_storeu_ps
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GROUP_DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define GROUP_DPBUSD _mm256_dpbusd_avx_epi32
#endif
#endif
#define HALVES (GROUP / LANES) /* vectors per group: 1 with AVX-512, 2 on AVX2 */

typedef struct {
    const int8_t *q;     /* [rows, k] codes */
    const float *scale;  /* [rows, k / BLOCK] */
    const int32_t *bias; /* [rows, k / BLOCK, 2] 128 times each half block's sum of codes */
} grouped_pass;

static inline gvec quad_of(const int8_t *a, int t) { /* activations 4t..4t+3, in every lane */
    int32_t v;
    memcpy(&v, a + 4 * t, sizeof v);
    return g_set1_i32(v);
}

/* steps [first, first + 4) (one half block) of every lane's row against activations a:
 * lane j's exact dot with row j's signed codes */
static inline gvec half_dot(const gvec codes[8], const int8_t *a, int first, int32_t bias) {
#ifdef GROUP_DPBUSD /* codes + 128 (unsigned) times the activations, from -128 times their sum */
    gvec p0 = GROUP_DPBUSD(g_set1_i32(-bias), codes[first], quad_of(a, first));
    gvec p1 = GROUP_DPBUSD(g_zero_i(), codes[first + 1], quad_of(a, first + 1));
    p0 = GROUP_DPBUSD(p0, codes[first + 2], quad_of(a, first + 2));
    p1 = GROUP_DPBUSD(p1, codes[first + 3], quad_of(a, first + 3));
    return g_add_i32(p0, p1);
#else /* llama.cpp's AVX2 dot: |w| times x with w's sign, a pair <= 2 * 128 * 127 (doing
       * the steps for all of a tile's rows at once, to make |w| once, spilled registers and
       * was measured slower) */
    (void)bias;
    const __m256i flip = _mm256_set1_epi8((char)0x80), one = _mm256_set1_epi16(1);
    gvec sum = g_zero_i();
    for (int t = first; t < first + 4; t++) {
        const __m256i w = _mm256_xor_si256(codes[t], flip);
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(quad_of(a, t), w));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, one));
    }
    return sum;
#endif
}

/* one pass's terms of block b for activation row m, added to acc in the stated order */
static inline __attribute__((always_inline)) gfvec group_terms(gfvec acc, const gvec codes[8], grouped_pass x,
                                                               int64_t k, int64_t m, int64_t b, const gfvec ws[2],
                                                               int per_block) {
    const int64_t at = m * (k / BLOCK) + b;
    const int8_t *a = x.q + m * k + b * BLOCK;
    const gfvec xs = g_set1_f(x.scale[at]);
    const gvec low = half_dot(codes, a, 0, x.bias[2 * at]);
    const gvec high = half_dot(codes, a, 4, x.bias[2 * at + 1]);
    if (per_block == 1) return g_fma(g_cvt(g_add_i32(low, high)), g_mul(ws[0], xs), acc);
    acc = g_fma(g_cvt(low), g_mul(ws[0], xs), acc);
    return g_fma(g_cvt(high), g_mul(ws[1], xs), acc);
}

/* a group's block of codes + 128, steps 0..7, for this vector's lanes (p: their first) */
static inline __attribute__((always_inline)) void load_codes(gvec codes[8], const uint8_t *p) {
#ifdef NIBBLE_TABLE
    int8_t shifted[16];
    for (int i = 0; i < 16; i++) shifted[i] = (int8_t)(nibble_values[i] ^ (int8_t)0x80);
    const gvec table = g_table(_mm_loadu_si128((const __m128i *)shifted)), low = g_set1_i8(15);
    for (int c = 0; c < 4; c++) {
        const gvec v = g_load(p + 64 * c);
        codes[c] = g_shuffle(table, g_and(v, low));
        codes[c + 4] = g_shuffle(table, g_and(g_srli16(v, 4), low));
    }
#else
    for (int t = 0; t < 8; t++) codes[t] = g_load(p + 64 * t);
#endif
}

/* `mt` activation rows from m0 times lanes [h * LANES, (h + 1) * LANES) of group g */
static inline __attribute__((always_inline)) void group_tile(grouped_pass x, grouped_pass x2, int fine, int64_t k,
                                                              const uint8_t *packed, const float *scales,
                                                              int per_block, int64_t g, int h, int64_t m0, int mt,
                                                              float *out, int64_t n, int valid) {
    const int64_t blocks = k / BLOCK;
    gfvec acc[GROUP_ROW_TILE];
    for (int i = 0; i < mt; i++) acc[i] = g_zero_f();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = packed + (g * blocks + b) * GROUP_BYTES + 4 * LANES * h;
        const float *s = scales + ((g * blocks + b) * per_block) * GROUP + LANES * h;
        gvec codes[8];
        load_codes(codes, p);
        gfvec ws[2];
        ws[0] = g_load_f(s);
        ws[1] = per_block == 2 ? g_load_f(s + GROUP) : ws[0];
        for (int i = 0; i < mt; i++) {
            acc[i] = group_terms(acc[i], codes, x, k, m0 + i, b, ws, per_block);
            if (fine) acc[i] = group_terms(acc[i], codes, x2, k, m0 + i, b, ws, per_block);
        }
    }
    const int first = h * LANES, count = valid - first < LANES ? valid - first : LANES;
    for (int i = 0; i < mt; i++) {
        float *row = out + (m0 + i) * n + g * GROUP + first;
        if (count == LANES) {
            g_store_f(row, acc[i]);
        } else if (count > 0) {
            float lane[LANES];
            g_store_f(lane, acc[i]);
            memcpy(row, lane, (size_t)count * sizeof(float));
        }
    }
}

static void group_rows(grouped_pass x, grouped_pass x2, int fine, int64_t rows, int64_t k, const uint8_t *packed,
                       const float *scales, int per_block, int64_t g, float *out, int64_t n, int valid) {
    for (int h = 0; h < HALVES; h++) {
        if (h * LANES >= valid) break;
        int64_t m0 = 0;
        if (per_block == 1) {
            for (; m0 + GROUP_ROW_TILE <= rows; m0 += GROUP_ROW_TILE)
                group_tile(x, x2, fine, k, packed, scales, 1, g, h, m0, GROUP_ROW_TILE, out, n, valid);
            for (; m0 < rows; m0++) group_tile(x, x2, fine, k, packed, scales, 1, g, h, m0, 1, out, n, valid);
        } else {
            for (; m0 + GROUP_ROW_TILE <= rows; m0 += GROUP_ROW_TILE)
                group_tile(x, x2, fine, k, packed, scales, 2, g, h, m0, GROUP_ROW_TILE, out, n, valid);
            for (; m0 < rows; m0++) group_tile(x, x2, fine, k, packed, scales, 2, g, h, m0, 1, out, n, valid);
        }
    }
}

/* 32 values -> int8 codes, their scale (peak / 127) and 128 times each half's sum of codes,
 * as `quantize_block` rounds them (to nearest even, in float32), 8 at a time; what the
 * codes miss goes to `residual`, if given */
static inline void quantize_block8(const __m256 v[4], int8_t *q, float *block_scale, int32_t *bias,
                                   __m256 *residual) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 peak = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
    p4 = _mm_max_ss(p4, _mm_movehdup_ps(p4));
    const float top = _mm_cvtss_f32(p4), scale = top / 127.0f;
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i c[4];
    for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse)); /* to nearest even */
    if (residual)
        for (int i = 0; i < 4; i++) residual[i] = _mm256_fnmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(c[i]), v[i]);
    for (int half = 0; half < 2; half++) {
        const __m256i total = _mm256_add_epi32(c[2 * half], c[2 * half + 1]);
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        bias[half] = 128 * _mm_cvtsi128_si32(t4);
    }
    /* |codes| <= 127: packing saturates nothing; the permute undoes the packs' lane order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *block_scale = scale;
}

/* one row's blocks -> codes, scales and biases; with q2, what those codes miss rounded
 * again the same way (`quantize_row`'s `fine`) */
static void quantize_grouped(const float *x, const float *input_scale, int64_t k, int8_t *q, float *scale,
                             int32_t *bias, int8_t *q2, float *scale2, int32_t *bias2) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m256 v[4], residual[4];
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * BLOCK + 8 * i);
            if (input_scale) v[i] = _mm256_mul_ps(v[i], _mm256_loadu_ps(input_scale + b * BLOCK + 8 * i));
        }
        quantize_block8(v, q + b * BLOCK, scale + b, bias + 2 * b, q2 ? residual : NULL);
        if (q2) quantize_block8(residual, q2 + b * BLOCK, scale2 + b, bias2 + 2 * b, NULL);
    }
}

/* x [rows, k] float32 (times input_scale [k], or NULL, before it is rounded) times the
 * grouped codes: 0 on success, 1 where k is not a multiple of BLOCK, 2 where per_block is
 * neither 1 nor 2. work: rows * (k + 12 * k / 32) bytes, twice with `fine` */
int llmq_int8_groups(const float *x, const float *input_scale, int fine, int64_t rows, int64_t k,
                     const uint8_t *packed, const float *scales, int64_t per_block, int64_t n, int threads,
                     void *work, float *out) {
    if (k % BLOCK != 0) return 1;
    if (per_block != 1 && per_block != 2) return 2;
    const int64_t blocks = k / BLOCK;
    grouped_pass passes[2];
    char *w = (char *)work;
    for (int pass = 0; pass < 2; pass++) {
        passes[pass].q = (const int8_t *)w;
        passes[pass].scale = (const float *)(w + rows * k);
        passes[pass].bias = (const int32_t *)(w + rows * k + 4 * rows * blocks);
        if (fine) w += rows * k + 12 * rows * blocks;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int64_t m = 0; m < rows; m++) {
        quantize_grouped(x + m * k, input_scale, k, (int8_t *)passes[0].q + m * k,
                         (float *)passes[0].scale + m * blocks, (int32_t *)passes[0].bias + 2 * m * blocks,
                         fine ? (int8_t *)passes[1].q + m * k : NULL, (float *)passes[1].scale + m * blocks,
                         (int32_t *)passes[1].bias + 2 * m * blocks);
    }
    const int64_t groups = (n + GROUP - 1) / GROUP;
    const int64_t chunks = (groups + GROUP_CHUNK - 1) / GROUP_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t g = c * GROUP_CHUNK; g < groups && g < (c + 1) * GROUP_CHUNK; g++) {
            const int valid = n - g * GROUP < GROUP ? (int)(n - g * GROUP) : GROUP;
            group_rows(passes[0], passes[1], fine, rows, k, packed, scales, (int)per_block, g, out, n, valid);
        }
    }
    return 0;
}
