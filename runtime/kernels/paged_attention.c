/* Causal GQA attention over the paged KV pool, one fixed order of arithmetic per row.
 *
 * Why: a BLAS matmul rounds a row's dot products differently with the number of rows it
 * is given and with how its keys are split into runs, so numpy attention gave a sequence
 * other numbers alone than batched, cold than after a prefix-cache hit, in prefill than in
 * decode (bench/invariance.py). Here every (query row, head) is computed by one thread, in
 * the same sequence of operations, from its own keys in position order: its result
 * depends on its query and its keys alone. See runtime/kernels/native.py for the build.
 *
 * q      [rows, q_stride] float32; head h of row t at q + t * q_stride + h * head_dim
 *        (already scaled by the attention scale)
 * keys   [kv_heads, pool_slots, head_dim] float32, values likewise (the pool's layout); built
 *        with -DKV_HALF, IEEE half (the torch backend's pool, as llama.cpp keeps its cache:
 *        half the bytes to read per key, which is what decode attention waits on)
 * slots  int64: for row t, slots[offset[t] .. offset[t] + count[t]) are the pool slots of
 *        the keys it sees, in position order
 * sinks  NULL, or [heads] float32: a learned logit per head that joins each row's softmax
 *        denominator and weighs no value (gpt-oss's attn_sinks, as ggml's soft_max with sinks)
 * out    [rows, heads * head_dim] float32
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "paged_attention.c needs AVX2, FMA and F16C (every CPU llmq runs on has them)"
#endif

#define LANES 8

#ifdef KV_HALF /* IEEE half keys and values, converted exactly to float32 on load (F16C) */
typedef uint16_t kv_t;
static inline __m256 load8(const kv_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline float scalar(kv_t x) { return _cvtsh_ss(x); }
#else
typedef float kv_t;
static inline __m256 load8(const kv_t *p) { return _mm256_loadu_ps(p); }
static inline float scalar(kv_t x) { return x; }
#endif

static inline float lanes_sum(__m256 acc, const float *a, const kv_t *b, int64_t d, int64_t n) {
    float lane[LANES];
    _mm256_storeu_ps(lane, acc);
    for (int l = 0; d < n; d++, l++) lane[l] += a[d] * scalar(b[d]);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

static float dot(const float *a, const kv_t *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), acc);
    return lanes_sum(acc, a, b, d, n);
}

/* `dot` of `a` with four vectors at once: four independent chains keep the FMA units busy
 * where one chain waits on its own latency; each result is `dot`'s, bit for bit. */
static void dot4(const float *a, const kv_t *b0, const kv_t *b1, const kv_t *b2, const kv_t *b3,
                 int64_t n, float *out) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) {
        const __m256 x = _mm256_loadu_ps(a + d);
        c0 = _mm256_fmadd_ps(x, load8(b0 + d), c0);
        c1 = _mm256_fmadd_ps(x, load8(b1 + d), c1);
        c2 = _mm256_fmadd_ps(x, load8(b2 + d), c2);
        c3 = _mm256_fmadd_ps(x, load8(b3 + d), c3);
    }
    if (d == n) { /* lanes_sum's tree for all four at once: the same sums, bit for bit */
        const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
        return;
    }
    out[0] = lanes_sum(c0, a, b0, d, n);
    out[1] = lanes_sum(c1, a, b1, d, n);
    out[2] = lanes_sum(c2, a, b2, d, n);
    out[3] = lanes_sum(c3, a, b3, d, n);
}

/* e^x for x <= 0 (scores minus their peak), 8 at a time: Cephes' expf polynomial on
 * x - n ln 2, times 2^n. Scalar expf took most of a decode row's attention (4500 calls a
 * layer for one SmolLM2 row at 500 tokens of context). */
static inline __m256 exp8(__m256 x) {
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f)); /* below: 0 to float precision */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, ln2_lo, _mm256_fnmadd_ps(n, ln2_hi, x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* s[j] = e^(s[j] - peak) for j < n, returning their sum (in a fixed order for every n) */
static float exp_shifted(float *s, int64_t n, float peak) {
    const __m256 shift = _mm256_set1_ps(peak);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
        _mm256_storeu_ps(s + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float lane[LANES];
    _mm256_storeu_ps(lane, sum8);
    float total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; j < n; j++) {
        s[j] = expf(s[j] - peak);
        total += s[j];
    }
    return total;
}

/* o += p * v over n values */
static void add_scaled(float *restrict o, float p, const kv_t *restrict v, int64_t n) {
    const __m256 scale = _mm256_set1_ps(p);
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(scale, load8(v + d), _mm256_loadu_ps(o + d)));
    for (; d < n; d++) o[d] += p * scalar(v[d]);
}

/* Keys and values are gathered by slot, so the hardware prefetcher sees short runs: each
 * loop asks for the key (or value) PREFETCH_AHEAD positions on while it works on this one.
 * A hint only: it changes no arithmetic. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 16
#endif

static inline void prefetch_vector(const kv_t *p, int64_t n) {
    const char *bytes = (const char *)p;
    for (int64_t off = 0; off < n * (int64_t)sizeof(kv_t); off += 64) _mm_prefetch(bytes + off, _MM_HINT_T0);
}

/* out[g] = sum over j of scores[g][j] * v_j for each head g, 64 dimensions at a time held
 * in registers: each output is the same chain of fmas as `add_scaled` over o in memory
 * gives it (from zero, in key order), without loading and storing o for every key. */
#define VALUE_TILE 64
static void weighted_values(const float *restrict scores, int64_t stride, int64_t group,
                            const kv_t *restrict values, const int64_t *restrict slots, int64_t count,
                            int64_t head_dim, float *restrict out) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += VALUE_TILE) {
        for (int64_t g = 0; g < group; g++) {
            const float *p = scores + g * stride;
            __m256 acc[VALUE_TILE / LANES];
            for (int i = 0; i < VALUE_TILE / LANES; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < count; j++) {
                const kv_t *v = values + slots[j] * head_dim + d0;
                if (g == 0 && j + PREFETCH_AHEAD < count)
                    prefetch_vector(values + slots[j + PREFETCH_AHEAD] * head_dim + d0, VALUE_TILE);
                const __m256 weight = _mm256_set1_ps(p[j]);
                for (int i = 0; i < VALUE_TILE / LANES; i++)
                    acc[i] = _mm256_fmadd_ps(weight, load8(v + i * LANES), acc[i]);
            }
            for (int i = 0; i < VALUE_TILE / LANES; i++) _mm256_storeu_ps(out + g * head_dim + d0 + i * LANES, acc[i]);
        }
    }
}

/* The `group` query heads that share one KV head, over that head's keys: each key and
 * value is read once for all of them. Head g's arithmetic is the same whatever `group` is. */
static void attend_group(const float *restrict q, int64_t group, const kv_t *restrict keys,
                         const kv_t *restrict values, const int64_t *restrict slots,
                         int64_t count, int64_t head_dim, float softcap, const float *sinks,
                         float *restrict scores, float *restrict out) {
    const int64_t stride = count + 1; /* head g's scores, then the inverse of their sum */
    int64_t j = 0;
    for (; j + 4 <= count; j += 4) {
        const kv_t *k0 = keys + slots[j] * head_dim, *k1 = keys + slots[j + 1] * head_dim;
        const kv_t *k2 = keys + slots[j + 2] * head_dim, *k3 = keys + slots[j + 3] * head_dim;
        for (int64_t a = j + PREFETCH_AHEAD; a < j + PREFETCH_AHEAD + 4 && a < count; a++)
            prefetch_vector(keys + slots[a] * head_dim, head_dim);
        for (int64_t g = 0; g < group; g++)
            dot4(q + g * head_dim, k0, k1, k2, k3, head_dim, scores + g * stride + j);
    }
    for (; j < count; j++) {
        const kv_t *k = keys + slots[j] * head_dim;
        for (int64_t g = 0; g < group; g++)
            scores[g * stride + j] = dot(q + g * head_dim, k, head_dim);
    }
    if (softcap > 0.0f) { /* Gemma 2: cap * tanh(score / cap), as llama.cpp's attn_soft_cap */
        const float inv = 1.0f / softcap;
        for (int64_t g = 0; g < group; g++)
            for (int64_t j = 0; j < count; j++)
                scores[g * stride + j] = tanhf(scores[g * stride + j] * inv) * softcap;
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * stride;
        float peak = -INFINITY;
        for (int64_t j = 0; j < count; j++) peak = s[j] > peak ? s[j] : peak;
        if (sinks == NULL) {
            s[count] = 1.0f / exp_shifted(s, count, peak);
            continue;
        }
        peak = sinks[g] > peak ? sinks[g] : peak; /* the sink joins the softmax, as a key would */
        const float total = exp_shifted(s, count, peak);
        s[count] = 1.0f / (total + expf(sinks[g] - peak));
    }
    if (head_dim % VALUE_TILE == 0) {
        weighted_values(scores, stride, group, values, slots, count, head_dim, out);
    } else {
        for (int64_t i = 0; i < group * head_dim; i++) out[i] = 0.0f;
        for (int64_t j = 0; j < count; j++) {
            const kv_t *v = values + slots[j] * head_dim;
            if (j + PREFETCH_AHEAD < count) prefetch_vector(values + slots[j + PREFETCH_AHEAD] * head_dim, head_dim);
            for (int64_t g = 0; g < group; g++)
                add_scaled(out + g * head_dim, scores[g * stride + j], v, head_dim);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = scores[g * stride + count];
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] *= inv;
    }
}

int llmq_paged_attention(const float *q, int64_t q_stride, const kv_t *keys,
                         const kv_t *values, int64_t pool_slots, const int64_t *slots,
                         const int64_t *offset, const int64_t *count, int64_t rows,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_count,
                         float softcap, const float *sinks, int threads, float *out) {
    const int64_t group = heads / kv_heads;
    /* Query heads per task: the whole group sharing a KV head (each key read once for all
     * of them), or one where that leaves too few tasks to keep the threads busy (a single
     * decode row has as many as KV heads: 3 for 2 threads). Head g's arithmetic is the
     * same either way, so the split never changes a result. */
    const int64_t per_task = rows * kv_heads >= 4 * (int64_t)threads ? group : 1;
    const int64_t tasks_per_row = heads / per_task;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * per_task * (max_count + 1));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * tasks_per_row; task++) {
            if (scores == NULL) { /* every thread still meets the loop's barrier */
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t t = task / tasks_per_row, first = (task % tasks_per_row) * per_task;
            const int64_t plane = (first / group) * pool_slots * head_dim;
            attend_group(q + t * q_stride + first * head_dim, per_task, keys + plane,
                         values + plane, slots + offset[t], count[t], head_dim, softcap,
                         sinks == NULL ? NULL : sinks + first, scores,
                         out + (t * heads + first) * head_dim);
        }
        free(scores);
    }
    return failed;
}
