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
 * keys   [kv_heads, pool_slots, head_dim] float32, values likewise (the pool's layout)
 * slots  int64: for row t, slots[offset[t] .. offset[t] + count[t]) are the pool slots of
 *        the keys it sees, in position order
 * out    [rows, heads * head_dim] float32
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 8

static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * b[d + l];
    for (int l = 0; d < n; d++, l++) acc[l] += a[d] * b[d];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* The `group` query heads that share one KV head, over that head's keys: each key and
 * value is read once for all of them. Head g's arithmetic is the same whatever `group` is. */
static void attend_group(const float *restrict q, int64_t group, const float *restrict keys,
                         const float *restrict values, const int64_t *restrict slots,
                         int64_t count, int64_t head_dim, float *restrict scores,
                         float *restrict out) {
    const int64_t stride = count + 1; /* head g's scores, then the inverse of their sum */
    for (int64_t j = 0; j < count; j++) {
        const float *k = keys + slots[j] * head_dim;
        for (int64_t g = 0; g < group; g++)
            scores[g * stride + j] = dot(q + g * head_dim, k, head_dim);
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * stride;
        float peak = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < count; j++) peak = s[j] > peak ? s[j] : peak;
        for (int64_t j = 0; j < count; j++) {
            s[j] = expf(s[j] - peak);
            total += s[j];
        }
        s[count] = 1.0f / total;
    }
    for (int64_t i = 0; i < group * head_dim; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < count; j++) {
        const float *v = values + slots[j] * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * stride + j];
            float *o = out + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) o[d] += p * v[d];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = scores[g * stride + count];
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] *= inv;
    }
}

int llmq_paged_attention(const float *q, int64_t q_stride, const float *keys,
                         const float *values, int64_t pool_slots, const int64_t *slots,
                         const int64_t *offset, const int64_t *count, int64_t rows,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_count,
                         int threads, float *out) {
    const int64_t group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * group * (max_count + 1));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * kv_heads; task++) {
            if (scores == NULL) { /* every thread still meets the loop's barrier */
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t t = task / kv_heads, kvh = task % kv_heads;
            const int64_t plane = kvh * pool_slots * head_dim;
            attend_group(q + t * q_stride + kvh * group * head_dim, group, keys + plane,
                         values + plane, slots + offset[t], count[t], head_dim, scores,
                         out + (t * heads + kvh * group) * head_dim);
        }
        free(scores);
    }
    return failed;
}
