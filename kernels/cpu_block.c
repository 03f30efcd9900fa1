/* The small per-row ops of a Llama block on CPU (add + RMS norm, rotary, SiLU * up), and the two
 * fused halves of a decode step's block built from them and the matmuls of cpu_wq_mm.c:
 *
 *   lowbit_block_pre:  residual += delta; h = norm(residual); qkv = h @ Wqkv^T (+ b); rotary(q, k)
 *   lowbit_block_post: o = attn @ Wo^T; residual += o; h = norm(residual);
 *                      gu = h @ Wgu^T; delta = (silu(gate) * up) @ Wdown^T
 *
 * Why: a decode step of the default model ran ~130 small torch ops per layer (~24 of its ~38 ms per
 * token went to them and their Python, not to the matmuls); the two calls replace all of them but
 * attention (kernels/cpu_native.py has the measurements). The standalone ops are the very functions
 * the fused calls run, so a row computed by the fused path equals, bit for bit, the row the unfused
 * path gives (the engine mixes both in one step: prompt rows exact, generated rows fast).
 *
 * Last, a whole single-token step in one call — lowbit_decode_layers over the contiguous cache,
 * lowbit_decode_paged_layers over the paged pool — runs these halves and cpu_attention.c's kernels
 * for every layer in the order the per-block path calls them, so it is bit-identical to that path.
 *
 * Every op works row by row in an order fixed by this code: a row's result never depends on the
 * other rows of the call (speculative verification and batching rely on it).
 * Built with cpu_wq_mm.c and cpu_attention.c into one library (kernels/cpu_native.py); -std=c11 keeps
 * GCC from contracting a*b + c into FMAs, so rotary equals the fp32 torch reference exactly.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"


/* Row loops of at least this many elements run on OpenMP's threads (torch's count: one libgomp); a row
 * is one thread's work either way, so results do not depend on it. Decode rows (M < 16) stay on one
 * thread: waking the others costs more than the loop (576-wide norm: ~1 us). */
#define PARALLEL_MIN 65536

/* y [M, N] = x [M, K] @ W^T (+ bias). */
int lowbit_linear_mm(const lowbit_linear *w, const float *x, int64_t M, float *y, int nthreads) {
    int rc;
    if (w->kind == 1) {
        float *xs = malloc(sizeof(float) * (size_t)(M * (w->K / w->group) + 1));
        if (!xs) return -2;
        rc = lowbit_int4_mm(x, M, w->K, w->codes, w->scales, w->P, w->N, w->group, xs, y, nthreads);
        free(xs);
    } else if (w->kind == 2) {
        rc = lowbit_int8_mm(x, M, w->K / w->group, w->N, w->group, w->codes, w->scales, (int)w->P, y, nthreads);
    } else {
        return -1;
    }
    if (rc == 0 && w->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < w->N; n++) y[m * w->N + n] += w->bias[n];
    return rc;
}

/* Per row m: r = res[m] + x[m] (r = x[m] when !has_res), res[m] = r, out[m] = r * rstd * w with
 * rstd = 1 / sqrt(mean(r^2) + eps). x rows are sx floats apart; res and out are [M, D]. The sum of
 * squares runs in 8 fixed lanes, then lane 0..7 in order. */
void lowbit_add_rms_norm(const float *x, int64_t sx, float *res, int has_res, const float *w, float eps,
                         int64_t M, int64_t D, float *out) {
#pragma omp parallel for schedule(static) if (M * D >= PARALLEL_MIN)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * sx;
        float *r = res + m * D, *o = out + m * D;
        float lanes[8] = {0};
        int64_t d = 0;
        for (; d + 8 <= D; d += 8)
            for (int l = 0; l < 8; l++) {
                const float v = has_res ? r[d + l] + xr[d + l] : xr[d + l];
                r[d + l] = v;
                lanes[l] += v * v;
            }
        float ss = 0.0f;
        for (; d < D; d++) {
            const float v = has_res ? r[d] + xr[d] : xr[d];
            r[d] = v;
            ss += v * v;
        }
        for (int l = 0; l < 8; l++) ss += lanes[l];
        const float rstd = 1.0f / sqrtf(ss / (float)D + eps);
        for (d = 0; d < D; d++) o[d] = r[d] * rstd * w[d];
    }
}

/* Rotate-half rotary in place on x [M, H, D] (rows sm floats apart, heads sh apart), cos/sin fp32
 * [M, D] with equal halves: x1' = x1 c - x2 s, x2' = x2 c + x1 s (the fp32 reference's arithmetic). */
void lowbit_rotary(float *x, int64_t M, int64_t H, int64_t sm, int64_t sh, int64_t D, const float *cos,
                   const float *sin) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (M * H * D >= PARALLEL_MIN)
    for (int64_t m = 0; m < M; m++) {
        const float *c = cos + m * D, *s = sin + m * D;
        for (int64_t h = 0; h < H; h++) {
            float *p = x + m * sm + h * sh;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = p[i], x2 = p[i + half];
                p[i] = x1 * c[i] - x2 * s[i];
                p[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* out [M, I] = silu(gate) * up; gate and up rows are sg and su floats apart. */
void lowbit_silu_mul(const float *gate, int64_t sg, const float *up, int64_t su, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M * I >= PARALLEL_MIN)
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < I; i++) {
            const float g = gate[m * sg + i];
            out[m * I + i] = g / (1.0f + expf(-g)) * up[m * su + i];
        }
}

/* delta [M, dim] (the previous block's output), residual [M, dim] (in/out; has_res = 0 for the first
 * block: residual := delta), cos/sin [M, D] → qkv [M, (H + 2 Hkv) D], q and k rotated. */
int lowbit_block_pre(const lowbit_block *b, int64_t M, const float *delta, float *residual, int has_res,
                     const float *cos, const float *sin, float *qkv, int nthreads) {
    float *h = malloc(sizeof(float) * (size_t)(M * b->dim));
    if (!h) return -2;
    lowbit_add_rms_norm(delta, b->dim, residual, has_res, b->attn_norm, b->eps, M, b->dim, h);
    const int rc = lowbit_linear_mm(&b->qkv, h, M, qkv, nthreads);
    free(h);
    if (rc) return rc;
    const int64_t D = b->head_dim, row = (b->n_heads + 2 * b->n_kv_heads) * D;
    lowbit_rotary(qkv, M, b->n_heads, row, D, D, cos, sin);
    lowbit_rotary(qkv + b->n_heads * D, M, b->n_kv_heads, row, D, D, cos, sin);
    return 0;
}

/* attn [M, H D] (attention's output), residual [M, dim] (in/out) → delta [M, dim]. */
int lowbit_block_post(const lowbit_block *b, int64_t M, const float *attn, float *residual, float *delta,
                      int nthreads) {
    const int64_t I = b->hidden;
    float *buf = malloc(sizeof(float) * (size_t)(M * (2 * b->dim + 3 * I)));
    if (!buf) return -2;
    float *o = buf, *h = o + M * b->dim, *gu = h + M * b->dim, *a = gu + M * 2 * I;
    int rc = lowbit_linear_mm(&b->o, attn, M, o, nthreads);
    if (rc == 0) {
        lowbit_add_rms_norm(o, b->dim, residual, 1, b->ffn_norm, b->eps, M, b->dim, h);
        rc = lowbit_linear_mm(&b->gate_up, h, M, gu, nthreads);
    }
    if (rc == 0) {
        lowbit_silu_mul(gu, 2 * I, gu + I, 2 * I, M, I, a);
        rc = lowbit_linear_mm(&b->down, a, M, delta, nthreads);
    }
    free(buf);
    return rc;
}

/* A whole single-token step over the contiguous fp32 cache, every block in turn: block_pre, decode
 * attention (cpu_attention.c) on layer l of the cache (element (l, b, h, s, d) at l * cl + b * cb +
 * h * ch + s * D + d), block_post — the very calls the per-block path makes from Python, in the same
 * order, so the result is bit-identical to it; one call instead of three per layer. delta [M, dim]:
 * the embeddings in, the last block's output out; residual [M, dim] out; scale: attention's 1/sqrt(D)
 * as the Python caller passes it to the per-block path. */
int lowbit_decode_layers(const lowbit_block *blocks, int64_t L, int64_t M, float *delta, float *residual,
                         const float *cos, const float *sin, float *cache_k, float *cache_v, int64_t cl, int64_t cb,
                         int64_t ch, int64_t S, const int64_t *pos, int64_t window, float scale, int nthreads) {
    const lowbit_block *b0 = blocks;
    const int64_t D = b0->head_dim, W = (b0->n_heads + 2 * b0->n_kv_heads) * D;
    float *qkv = malloc(sizeof(float) * (size_t)(M * W)), *attn = malloc(sizeof(float) * (size_t)(M * b0->n_heads * D));
    int rc = qkv && attn ? 0 : -2;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const lowbit_block *b = blocks + l;
        rc = lowbit_block_pre(b, M, delta, residual, l > 0, cos, sin, qkv, nthreads);
        if (rc == 0)
            rc = lowbit_decode_attention(qkv, W, qkv + b->n_heads * D, qkv + (b->n_heads + b->n_kv_heads) * D, W,
                                         cache_k + l * cl, cache_v + l * cl, cb, ch, M, b->n_heads, b->n_kv_heads, S, D,
                                         pos, window, scale, attn, nthreads);
        if (rc == 0) rc = lowbit_block_post(b, M, attn, residual, delta, nthreads);
    }
    free(qkv);
    free(attn);
    return rc;
}

/* A whole decode step over the paged pool (runtime/kv_cache.py), every row one token: per block,
 * block_pre, the K and V of the step quantized into their slots (kv_write, rotated by write_rot when
 * the format rotates), paged decode attention over each row's first ctx[r] tokens (attn_rot: both
 * sides rotated), block_post — the calls the per-block path makes from Python, in the same order,
 * so the result is bit-identical to it. k_sides/v_sides: one descriptor per layer. */
int lowbit_decode_paged_layers(const lowbit_block *blocks, int64_t L, int64_t M, float *delta, float *residual,
                               const float *cos, const float *sin, const int64_t *slots, int64_t page_size,
                               const lowbit_kv_side *k_sides, const lowbit_kv_side *v_sides, const float *write_rot,
                               const float *attn_rot, const int64_t *ctx, const int64_t *tables, const int64_t *toff,
                               int64_t window, float scale, int nthreads) {
    const lowbit_block *b0 = blocks;
    const int64_t D = b0->head_dim, H = b0->n_heads, Hkv = b0->n_kv_heads, W = (H + 2 * Hkv) * D;
    float *qkv = malloc(sizeof(float) * (size_t)(M * W)), *attn = malloc(sizeof(float) * (size_t)(M * H * D));
    int rc = qkv && attn ? 0 : -2;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const lowbit_block *b = blocks + l;
        rc = lowbit_block_pre(b, M, delta, residual, l > 0, cos, sin, qkv, nthreads);
        if (rc == 0) rc = lowbit_kv_write(qkv + H * D, W, M, Hkv, D, slots, page_size, k_sides + l, write_rot);
        if (rc == 0) rc = lowbit_kv_write(qkv + (H + Hkv) * D, W, M, Hkv, D, slots, page_size, v_sides + l, write_rot);
        if (rc == 0)
            rc = lowbit_paged_decode_attention(qkv, W, M, H, Hkv, D, ctx, tables, toff, page_size, k_sides + l,
                                               v_sides + l, attn_rot, window, scale, attn, nthreads);
        if (rc == 0) rc = lowbit_block_post(b, M, attn, residual, delta, nthreads);
    }
    free(qkv);
    free(attn);
    return rc;
}
