/* GGUF blocks straight into the engine's kernel layouts, for a cold load.
 *
 * runtime/kernels/gguf_blocks.py reads a tensor's blocks into codes and float32 scales with
 * numpy, and runtime/kernels/native.py packs those for the kernels; for a Llama 3.2 1B
 * Q4_K_M file that took most of a 15 s load (bench/cold_load.py). Here each row goes from
 * the file's bytes to its place in the packed layout in one pass, with the same float32
 * arithmetic as the numpy readers (a scale is `d * sub-scale`, times the part's factor,
 * then rounded to IEEE half where the layout keeps halves), so a weight packed here is
 * bitwise the one packed there (tests/runtime/test_repack.py). Rows are independent: a
 * destination row's bytes are its own, so rows are spread over `threads` OpenMP threads
 * (runtime/kernels/repack.py says how many).
 *
 *   llmq_q4k_lowbit: Q4_K rows -> lowbit_rows.c's 4-bit layout (see its header)
 *   llmq_int8_groups: Q8_0 / Q6_K rows -> int8_rows.c's grouped layout (native.py
 *       pack_int8_groups: codes plus 128, 16 rows side by side; float32 scales)
 *   llmq_int8_head: Q8_0 / Q6_K rows dequantized, requantized to int8 per row with a bf16
 *       scale (torch_backend.py Int8Weight.quantized) and laid out for lowbit_rows.c's
 *       8-bit build (native.py pack_int8_rows)
 *   llmq_ranking: Q8_0 / Q6_K rows dequantized, requantized to 4 bits with a scale and min
 *       per 32 (gguf_blocks.py quantize_groups: a large head's int4 ranking,
 *       torch_backend.py RescoredHead) in lowbit_rows.c's 4-bit layout
 *
 * `order` (or NULL) picks source rows: destination row `first + r` is source row order[r].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK_K 256
#define GGML_Q8_0 8
#define GGML_Q6_K 14

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 1024));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 1023) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* round to nearest even, as numpy's float32 -> float16 */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 255, man = x & 0x7fffff;
    if (exp == 255) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 | (man >> 13) : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000;
        int shift = 14 - e;
        uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = (uint32_t)e << 10 | man >> 13, rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++; /* may carry into exp */
    return (uint16_t)(sign | half);
}

/* round to nearest even, as torch's float32 -> bfloat16 (NaN kept quiet) */
static float round_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) {
        x = 0x7fc00000;
    } else {
        x += 0x7fff + ((x >> 16) & 1);
        x &= 0xffff0000u;
    }
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* lowbit_rows.c's 4-bit layout: group g's block b is `block_bytes` bytes */
void llmq_q4k_lowbit(const uint8_t *raw, int64_t row_bytes, const int64_t *order, int64_t n,
                     int64_t k, float factor, uint8_t *packed, int64_t first, int threads) {
    const int64_t blocks = k / 32, block_bytes = 320;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = raw + (order ? order[r] : r) * row_bytes;
        int64_t dst = first + r, g = dst / 16, j = dst % 16;
        uint8_t *out = packed + g * blocks * block_bytes;
        for (int64_t sb = 0; sb < k / QK_K; sb++) {
            const uint8_t *blk = row + sb * 144, *q = blk + 4, *qs = blk + 16;
            float d = half_to_float(read_u16(blk)), dmin = half_to_float(read_u16(blk + 2));
            for (int s = 0; s < 8; s++) {
                int sc, m;
                if (s < 4) {
                    sc = q[s] & 63;
                    m = q[s + 4] & 63;
                } else {
                    sc = (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
                    m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
                }
                float scale = d * (float)sc, min = -dmin * (float)m;
                uint8_t *o = out + (sb * 8 + s) * block_bytes;
                uint16_t hs = float_to_half(scale * factor), hm = float_to_half(min * factor);
                memcpy(o + 256 + 2 * j, &hs, 2);
                memcpy(o + 288 + 2 * j, &hm, 2);
                const uint8_t *src = qs + (s / 2) * 32;
                int shift = (s & 1) * 4;
                for (int c = 0; c < 4; c++) { /* 4 codes a word: 4c + i low, 16 + 4c + i high */
                    uint32_t lo, hi;
                    memcpy(&lo, src + 4 * c, 4);
                    memcpy(&hi, src + 16 + 4 * c, 4);
                    uint32_t word = ((lo >> shift) & 0x0f0f0f0fu) | ((hi >> shift) & 0x0f0f0f0fu) << 4;
                    memcpy(o + c * 64 + j * 4, &word, 4);
                }
            }
        }
    }
}

/* one row's signed codes (k) and its scales per `step` weights (k / step) as the numpy
 * readers give them (gguf_blocks.read_eight_bit) */
static void read_row(const uint8_t *row, int type, int64_t k, int8_t *codes, float *scales) {
    if (type == GGML_Q8_0) {
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *blk = row + b * 34;
            scales[b] = half_to_float(read_u16(blk));
            memcpy(codes + b * 32, blk + 2, 32);
        }
        return;
    }
    for (int64_t sb = 0; sb < k / QK_K; sb++) { /* Q6_K */
        const uint8_t *blk = row + sb * 210;
        float d = half_to_float(read_u16(blk + 208));
        for (int s = 0; s < 16; s++) scales[sb * 16 + s] = d * (float)(int8_t)blk[192 + s];
        int8_t *c = codes + sb * QK_K;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + h * 64, *qh = blk + 128 + h * 32;
            for (int l = 0; l < 32; l++) {
                c[h * 128 + l] = (int8_t)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
                c[h * 128 + 32 + l] = (int8_t)(((ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                c[h * 128 + 64 + l] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                c[h * 128 + 96 + l] = (int8_t)(((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

static int64_t scale_step(int type) { return type == GGML_Q8_0 ? 32 : 16; }

/* value = scale * code in float32, as gguf's dequantize_blocks */
static void dequantize(const int8_t *codes, const float *sc, int64_t k, int64_t step, float *v) {
    for (int64_t s = 0; s < k / step; s++)
        for (int64_t c = s * step; c < (s + 1) * step; c++) v[c] = sc[s] * (float)codes[c];
}

/* int8_rows.c's grouped layout: packed [groups, k/32, 512], scales [groups, k/32, per, 16]
 * with `per` 1 or 2 scales a block of 32 (a Q8_0 part's scale twice where per is 2) */
int llmq_int8_groups(const uint8_t *raw, int64_t row_bytes, int type, const int64_t *order,
                     int64_t n, int64_t k, float factor, int per, uint8_t *packed, float *scales,
                     int64_t first, int threads) {
    if (type != GGML_Q8_0 && type != GGML_Q6_K) return -1;
    const int64_t blocks = k / 32, step = scale_step(type);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int8_t *codes = malloc(k);
        float *sc = malloc(sizeof(float) * (k / 16));
        if (!codes || !sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (!codes || !sc) continue;
            read_row(raw + (order ? order[r] : r) * row_bytes, type, k, codes, sc);
            int64_t dst = first + r, g = dst / 16, j = dst % 16;
            uint8_t *out = packed + g * blocks * 512;
            float *so = scales + g * blocks * per * 16;
            for (int64_t b = 0; b < blocks; b++) {
                for (int t = 0; t < 8; t++) { /* codes 4t .. 4t + 3, each plus 128 */
                    uint32_t word;
                    memcpy(&word, codes + b * 32 + t * 4, 4);
                    word ^= 0x80808080u;
                    memcpy(out + b * 512 + t * 64 + j * 4, &word, 4);
                }
                for (int p = 0; p < per; p++)
                    so[(b * per + p) * 16 + j] = sc[(b * 32 + p * (32 / per)) / step] * factor;
            }
        }
        free(codes);
        free(sc);
    }
    return failed ? -2 : 0;
}

/* each of n Q8_0 / Q6_K rows dequantized (`dequantize`) and handed to `pack` with its
 * destination row first + r, the rows spread over `threads` OpenMP threads; -1 for another
 * type, -2 where a thread's buffers could not be allocated */
typedef void (*pack_row)(const float *v, int64_t k, int64_t dst, uint8_t *packed);

static int dequantized_rows(const uint8_t *raw, int64_t row_bytes, int type, int64_t n,
                            int64_t k, uint8_t *packed, int64_t first, int threads,
                            pack_row pack) {
    if (type != GGML_Q8_0 && type != GGML_Q6_K) return -1;
    const int64_t step = scale_step(type);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int8_t *codes = malloc(k);
        float *sc = malloc(sizeof(float) * (k / 16)), *v = malloc(sizeof(float) * k);
        if (!codes || !sc || !v) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (!codes || !sc || !v) continue;
            read_row(raw + r * row_bytes, type, k, codes, sc);
            dequantize(codes, sc, k, step, v);
            pack(v, k, first + r, packed);
        }
        free(codes);
        free(sc);
        free(v);
    }
    return failed ? -2 : 0;
}

/* lowbit_rows.c's 8-bit layout of the rows requantized to int8: per group, k/32 blocks of
 * 512 bytes (row j's code 4t + i plus 128 at t * 64 + j * 4 + i), then 16 float32 scales;
 * a row's scale is bf16(peak / 127), its codes round(value / scale) within +-127 */
static void int8_head_row(const float *v, int64_t k, int64_t dst, uint8_t *packed) {
    const int64_t blocks = k / 32, group_bytes = blocks * 512 + 64;
    float peak = 0.0f;
    for (int64_t c = 0; c < k; c++) {
        float a = fabsf(v[c]);
        peak = a > peak ? a : peak;
    }
    peak = peak > 1e-30f ? peak : 1e-30f;
    float scale = round_bf16(peak / 127.0f);
    int64_t g = dst / 16, j = dst % 16;
    uint8_t *out = packed + g * group_bytes;
    for (int64_t c = 0; c < k; c++) {
        float q = rintf(v[c] / scale); /* nearest even, as torch.round */
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        int64_t b = c / 32, t = (c % 32) / 4, i = c % 4;
        out[b * 512 + t * 64 + j * 4 + i] = (uint8_t)((int)q + 128);
    }
    memcpy(out + blocks * 512 + 4 * j, &scale, 4);
}

int llmq_int8_head(const uint8_t *raw, int64_t row_bytes, int type, int64_t n, int64_t k,
                   uint8_t *packed, int64_t first, int threads) {
    return dequantized_rows(raw, row_bytes, type, n, k, packed, first, threads, int8_head_row);
}

/* quantize_groups then pack_lowbit(.., 4): per 32 values low = min, scale = max((max -
 * low) / 15, 1e-12), code = rint((value - low) / scale) within 0..15; scale and low as
 * halves */
static void ranking_row(const float *v, int64_t k, int64_t dst, uint8_t *packed) {
    const int64_t blocks = k / 32, block_bytes = 320;
    int64_t g = dst / 16, j = dst % 16;
    uint8_t *out = packed + g * blocks * block_bytes;
    for (int64_t b = 0; b < blocks; b++) {
        const float *x = v + b * 32;
        float low = x[0], high = x[0];
        for (int c = 1; c < 32; c++) {
            low = x[c] < low ? x[c] : low;
            high = x[c] > high ? x[c] : high;
        }
        float scale = (high - low) / 15.0f;
        scale = scale > 1e-12f ? scale : 1e-12f;
        uint8_t q[32];
        for (int c = 0; c < 32; c++) { /* rintf: nearest even, as np.rint */
            float y = rintf((x[c] - low) / scale);
            q[c] = (uint8_t)(y < 0.0f ? 0.0f : (y > 15.0f ? 15.0f : y));
        }
        uint8_t *o = out + b * block_bytes;
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 4; i++)
                o[c * 64 + j * 4 + i] = (uint8_t)(q[4 * c + i] | q[16 + 4 * c + i] << 4);
        uint16_t hs = float_to_half(scale), hm = float_to_half(low);
        memcpy(o + 256 + 2 * j, &hs, 2);
        memcpy(o + 288 + 2 * j, &hm, 2);
    }
}

int llmq_ranking(const uint8_t *raw, int64_t row_bytes, int type, int64_t n, int64_t k,
                 uint8_t *packed, int64_t first, int threads) {
    return dequantized_rows(raw, row_bytes, type, n, k, packed, first, threads, ranking_row);
}
