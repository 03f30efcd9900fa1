/* The small per-row ops of a Llama block on CPU (add + RMS norm, rotary, SiLU * up), and the two
 * fused halves of a decode step's block built from them and the matmuls of cpu_wq_mm.c:
 *
 *   lowbit_block_pre:  residual += delta; h = norm(residual); qkv = h @ Wqkv^T (+ b); q/k head norms
 *                      (Qwen3; when the block has them); rotary(q, k)
 *   lowbit_block_post: o = attn @ Wo^T; residual += o; h = norm(residual);
 *                      gu = h @ Wgu^T; delta = (silu(gate) * up) @ Wdown^T
 *
 * Why: a decode step of the default model ran ~130 small torch ops per layer (~24 of its ~38 ms per
 * token went to them and their Python, not to the matmuls); the two calls replace all of them but
 * attention (kernels/cpu_native.py has the measurements). The standalone ops are the very functions
 * the fused calls run, so a row computed by the fused path equals, bit for bit, the row the unfused
 * path gives (the engine mixes both in one step: prompt rows exact, generated rows fast).
 *
 * Last, a whole decode step in one call — lowbit_decode_paged_layers over the paged pool — runs
 * these halves and cpu_attention.c's kernels for every layer in the order the per-block path calls
 * them, so it is bit-identical to that path.
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
/* q/k norms run on a stack copy of one head (Gemma's 256 is the widest shipped) */
#define LOWBIT_MAX_HEAD_DIM 512

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

/* out[0..n) = act(g) * u = g / (1 + exp(-a)) * u: SiLU with a = g, or GELU's tanh approximation (gelu = 1,
 * Gemma's GeGLU) with a = 2z, z = sqrt(2/pi) (g + 0.044715 g^3), since 0.5 g (1 + tanh z) = g / (1 + exp(-2z)).
 * 8 at a time (exp8), the tail through the same lanes: each value's arithmetic is the same wherever it
 * falls, so the fused and the standalone op agree. */
static inline void gated_mul_n(const float *g, const float *u, int64_t n, float *out, int gelu) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    const __m256 k = _mm256_set1_ps(-1.5957691216057308f), c = _mm256_set1_ps(0.044715f);  /* -2 sqrt(2/pi) */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 a = gelu ? _mm256_mul_ps(k, _mm256_add_ps(gv, _mm256_mul_ps(c, _mm256_mul_ps(gv, _mm256_mul_ps(gv, gv)))))
                              : _mm256_xor_ps(gv, neg);
        const __m256 e = exp8(a);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    if (i < n) {
        float gt[8] = {0}, ut[8] = {0}, ot[8];
        for (int64_t j = 0; i + j < n; j++) gt[j] = g[i + j], ut[j] = u[i + j];
        gated_mul_n(gt, ut, 8, ot, gelu);
        for (int64_t j = 0; i + j < n; j++) out[i + j] = ot[j];
    }
}

/* out [M, I] = act(gate) * up; gate and up rows are sg and su floats apart. */
static void gated_mul_rows(const float *gate, int64_t sg, const float *up, int64_t su, int64_t M, int64_t I,
                           float *out, int gelu) {
#pragma omp parallel for schedule(static) if (M * I >= PARALLEL_MIN)
    for (int64_t m = 0; m < M; m++) gated_mul_n(gate + m * sg, up + m * su, I, out + m * I, gelu);
}

void lowbit_gated_mul_n(const float *g, const float *u, int64_t n, float *out, int gelu) {
    gated_mul_n(g, u, n, out, gelu);
}

void lowbit_silu_mul(const float *gate, int64_t sg, const float *up, int64_t su, int64_t M, int64_t I, float *out) {
    gated_mul_rows(gate, sg, up, su, M, I, out, 0);
}

void lowbit_gelu_tanh_mul(const float *gate, int64_t sg, const float *up, int64_t su, int64_t M, int64_t I,
                          float *out) {
    gated_mul_rows(gate, sg, up, su, M, I, out, 1);
}

/* ---- the fused halves of a block ---- */

/* A block's scratch for M rows: h, o [M, dim], gu [M, 2 hidden], and the quantized activations of
 * its widest input (each matmul re-views the same memory for its own K). */
typedef struct {
    float *h, *o, *gu;
    void *qmem;
    void *moe_mem;  /* a mixture of experts' scratch (lowbit_moe_scratch), after qmem; unused by a dense block */
    int64_t M;
} block_ws;

static int64_t widest_input(const lowbit_block *b) {
    const int64_t hd = b->n_heads * b->head_dim, k = b->dim > hd ? b->dim : hd;
    return k > b->hidden ? k : b->hidden;
}

static size_t block_ws_bytes(const lowbit_block *b, int64_t M) {
    return sizeof(float) * (size_t)(M * (2 * b->dim + 2 * b->hidden)) + 64 + lowbit_qact_bytes(M, widest_input(b)) +
           (b->moe ? lowbit_moe_scratch(b->moe, M, b->moe->k) + 64 : 0);
}

static void block_ws_init(block_ws *ws, void *mem, const lowbit_block *b, int64_t M) {
    float *f = mem;
    ws->h = f, ws->o = f + M * b->dim, ws->gu = ws->o + M * b->dim;
    ws->qmem = ws->gu + 2 * M * b->hidden;
    ws->moe_mem = (void *)(((uintptr_t)ws->qmem + lowbit_qact_bytes(M, widest_input(b)) + 63) & ~(uintptr_t)63);
    ws->M = M;
}

/* A workspace of its own for one call: the memory to free, NULL where malloc failed. */
static void *block_ws_new(block_ws *ws, const lowbit_block *b, int64_t M) {
    void *mem = malloc(block_ws_bytes(b, M));
    if (mem) block_ws_init(ws, mem, b, M);
    return mem;
}

static lowbit_qact qact_for(const block_ws *ws, int64_t K) {
    lowbit_qact a;
    lowbit_qact_init(&a, ws->qmem, ws->M, K);
    return a;
}

static int block_check(const lowbit_ctx *c, const lowbit_block *b) {
    const int64_t D = b->head_dim, H = b->n_heads, Hkv = b->n_kv_heads;
    const lowbit_linear *ws[4] = {&b->qkv, &b->o, &b->gate_up, &b->down};
    for (int i = 0; i < (b->moe ? 2 : 4); i++)  /* a mixture of experts has no gate_up and down of its own */
        if (lowbit_linear_check(ws[i], c->isa)) return -1;
    if (lowbit_linear_rows(&b->qkv) != (H + 2 * Hkv) * D || b->qkv.K != b->dim || lowbit_linear_rows(&b->o) != b->dim || b->o.K != H * D)
        return -1;
    /* a mixture of experts: its 2 E weights were checked when its descriptor was made (kernels/cpu_moe.py calls
     * lowbit_moe_check; its 256 checks a layer, each asking the CPU for its ISA, would cost an estimated
     * 5-10 us a layer every step), the rest here */
    if (b->moe ? !b->moe->router || b->moe->dim != b->dim || b->moe->k < 1 ||
                     b->moe->k > b->moe->n_experts || b->moe->rule < 0 || b->moe->rule > 1
               : lowbit_linear_rows(&b->gate_up) != 2 * b->hidden || b->gate_up.K != b->dim ||
                     lowbit_linear_rows(&b->down) != b->dim || b->down.K != b->hidden)
        return -1;
    if ((b->q_norm == NULL) != (b->k_norm == NULL) || (b->q_norm && D > LOWBIT_MAX_HEAD_DIM) ||
        (b->attn_post_norm == NULL) != (b->ffn_post_norm == NULL) || b->act < 0 || b->act > 1 || b->rope < 0 ||
        b->window < 0)
        return -1;
    return 0;
}

/* Team, rows shared out: residual += x; h = norm(residual); a = h's activation codes — one row per
 * iteration, so a prompt's rows keep both threads busy (a 512-row prompt at 8B on one thread cost ~6%
 * of its prefill) and a decode step's one row costs what a `single` did. */
static void norm_quantize_rows(const float *x, int64_t sx, float *residual, int has_res, const float *w, float eps,
                               int64_t M, int64_t dim, float *h, lowbit_qact *a) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        lowbit_add_rms_norm(x + m * sx, sx, residual + m * dim, has_res, w, eps, 1, dim, h + m * dim);
        for (int64_t bk = 0; bk < a->nb; bk++) lowbit_quantize_block(h + m * dim + bk * LOWBIT_BLOCK, a, m, bk);
    }
}

/* Team: residual += delta; h = norm(residual); qkv = h @ Wqkv^T (+ b); rotary on q and k. */
static void block_pre_team(const lowbit_ctx *c, const lowbit_block *b, int64_t M, const float *delta, float *residual,
                           int has_res, const float *cos, const float *sin, float *qkv, block_ws *ws) {
    lowbit_qact a = qact_for(ws, b->dim);
    norm_quantize_rows(delta, b->dim, residual, has_res, b->attn_norm, b->eps, M, b->dim, ws->h, &a);
    lowbit_linear_team(c, &b->qkv, &a, qkv);
    const int64_t D = b->head_dim, row = (b->n_heads + 2 * b->n_kv_heads) * D;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        if (b->q_norm) {  /* each head normed on its own, as the per-op path's add_rms_norm rows: same bits */
            float tmp[LOWBIT_MAX_HEAD_DIM];
            for (int64_t h = 0; h < b->n_heads + b->n_kv_heads; h++) {
                float *x = qkv + m * row + h * D;
                lowbit_add_rms_norm(x, D, tmp, 0, h < b->n_heads ? b->q_norm : b->k_norm, b->eps, 1, D, x);
            }
        }
        lowbit_rotary(qkv + m * row, 1, b->n_heads, row, D, D, cos + m * D, sin + m * D);
        lowbit_rotary(qkv + m * row + b->n_heads * D, 1, b->n_kv_heads, row, D, D, cos + m * D, sin + m * D);
    }
}

/* Team: delta = (act(h Wg^T) * (h Wu^T)) @ Wd^T, a: h's activation codes (the dense gated MLP). */
static void dense_mlp_team(const lowbit_ctx *c, const lowbit_block *b, int64_t M, float *delta, block_ws *ws,
                           const lowbit_qact *ah) {
    const int64_t I = b->hidden;
    lowbit_linear_team(c, &b->gate_up, ah, ws->gu);
    lowbit_qact a = qact_for(ws, I);
    /* silu(gate) * up and its quantization, one block of 32 at a time, shared out (expf is most of a
     * decode step's serial time otherwise: 1536 per layer on the default model) */
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * a.nb; i++) {
        const int64_t m = i / a.nb, k0 = (i % a.nb) * LOWBIT_BLOCK;
        float act[LOWBIT_BLOCK];
        gated_mul_n(ws->gu + m * 2 * I + k0, ws->gu + m * 2 * I + I + k0, LOWBIT_BLOCK, act, (int)b->act);
        lowbit_quantize_block(act, &a, m, i % a.nb);
    }
    lowbit_linear_team(c, &b->down, &a, delta);
}

/* Team: residual += attn @ Wo^T; h = norm(residual); delta = (silu(h Wg^T) * (h Wu^T)) @ Wd^T — with Gemma's
 * norms of the attention and MLP outputs (attn_post_norm, ffn_post_norm) and GeGLU where the block has them. */
static void block_post_team(const lowbit_ctx *c, const lowbit_block *b, int64_t M, const float *attn, float *residual,
                            float *delta, block_ws *ws) {
    lowbit_qact a = qact_for(ws, b->n_heads * b->head_dim);
    lowbit_quantize_rows(attn, a.K, &a);
    lowbit_linear_team(c, &b->o, &a, ws->o);
    if (b->attn_post_norm) {  /* Gemma: the attention output normed before the residual add (h: scratch) */
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            lowbit_add_rms_norm(ws->o + m * b->dim, b->dim, ws->h + m * b->dim, 0, b->attn_post_norm, b->eps, 1, b->dim,
                                ws->o + m * b->dim);
    }
    a = qact_for(ws, b->dim);
    norm_quantize_rows(ws->o, b->dim, residual, 1, b->ffn_norm, b->eps, M, b->dim, ws->h, &a);
    if (b->moe)  /* router and experts on the normed rows (cpu_moe.c), the op-by-op path's calls' arithmetic */
        lowbit_moe_team(c, b->moe, M, ws->h, delta, ws->moe_mem);
    else
        dense_mlp_team(c, b, M, delta, ws, &a);
    if (b->ffn_post_norm) {  /* Gemma: the MLP output normed before it is added (h: scratch) */
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            lowbit_add_rms_norm(delta + m * b->dim, b->dim, ws->h + m * b->dim, 0, b->ffn_post_norm, b->eps, 1, b->dim,
                                delta + m * b->dim);
    }
}

/* delta [M, dim] (the previous block's output), residual [M, dim] (in/out; has_res = 0 for the first
 * block: residual := delta), cos/sin [M, D] → qkv [M, (H + 2 Hkv) D], q and k rotated. Returns 0, -1
 * for a layout the kernels do not take, -2 for a failed allocation. */
int lowbit_block_pre(const lowbit_ctx *c, const lowbit_block *b, int64_t M, const float *delta, float *residual,
                     int has_res, const float *cos, const float *sin, float *qkv) {
    if (M < 1 || block_check(c, b)) return -1;
    block_ws ws;
    void *mem = block_ws_new(&ws, b, M);
    if (!mem) return -2;
#pragma omp parallel num_threads((int)c->nthreads)
    block_pre_team(c, b, M, delta, residual, has_res, cos, sin, qkv, &ws);
    free(mem);
    return 0;
}

/* attn [M, H D] (attention's output), residual [M, dim] (in/out) → delta [M, dim]. */
int lowbit_block_post(const lowbit_ctx *c, const lowbit_block *b, int64_t M, const float *attn, float *residual,
                      float *delta) {
    if (M < 1 || block_check(c, b)) return -1;
    block_ws ws;
    void *mem = block_ws_new(&ws, b, M);
    if (!mem) return -2;
#pragma omp parallel num_threads((int)c->nthreads)
    block_post_team(c, b, M, attn, residual, delta, &ws);
    free(mem);
    return 0;
}

/* A whole decode step over the paged pool (runtime/engine/kv_cache.py), every row one token, in one parallel
 * region: per block, block_pre with its layer's rotary table (cos/sin [n_tables, M, D]: Gemma 3's local and
 * global kinds, or an identity table for SmolLM3's layers without rotary), the K and V of the step quantized into their slots (kv_write, rotated
 * by write_rot when the format rotates), paged decode attention over each row's first ctx[r] tokens (within the block's window)
 * (attn_rot: the pool's rotation, which attention applies to each layer's quantized sides only, as write_rot
 * does: a pool may give each layer its own format; both are the rotation's D signs, cpu_attention.c `rotate`;
 * the block's sinks, if any),
 * block_post — the arithmetic of the per-block path, in the same order, so the result is
 * bit-identical to it. k_sides/v_sides: one descriptor per layer. Scratch is
 * allocated once for the step. Returns 0, -1 for shapes it does not take, -2 for a failed allocation. */
int lowbit_decode_paged_layers(const lowbit_ctx *c, const lowbit_block *blocks, int64_t L, int64_t M, float *delta,
                               float *residual, const float *cos, const float *sin, int64_t n_tables,
                               const int64_t *slots, int64_t page_size, const lowbit_kv_side *k_sides,
                               const lowbit_kv_side *v_sides, const float *write_rot, const float *attn_rot,
                               const int64_t *ctx, const int64_t *tables, const int64_t *toff, float scale) {
    if (L < 1 || M < 1 || n_tables < 1) return -1;
    const lowbit_block *b0 = blocks;
    const int64_t D = b0->head_dim, H = b0->n_heads, Hkv = b0->n_kv_heads, W = (H + 2 * Hkv) * D;
    for (int64_t l = 0; l < L; l++)
        if (block_check(c, blocks + l) || blocks[l].head_dim != D || blocks[l].n_heads != H ||
            blocks[l].n_kv_heads != Hkv || blocks[l].dim != b0->dim || blocks[l].hidden != b0->hidden ||
            blocks[l].rope >= n_tables)
            return -1;
    for (int64_t r = 0; r < M; r++)
        if (ctx[r] < 1) return -1;
    if (H % Hkv || D % 8 || D > 512) return -1;  /* paged attention's vector steps and group count */
    /* attention's chunks: the most any layer needs (a window only ever cuts a row's keys); a layer whose
     * window differs from the last one's plans again (Gemma 3: local and global layers) */
    int64_t nc = 0;
    for (int64_t l = 0; l < L; l++) {
        const int64_t n = lowbit_paged_attention_plan(M, ctx, blocks[l].window, NULL);
        nc = n > nc ? n : nc;
    }
    const size_t att = lowbit_paged_attention_scratch(H, Hkv, D), parts = lowbit_paged_attention_partials(nc, H, D);
    size_t wsb = 0;  /* the layers share one block scratch: the largest (an MoE layer's experts need more) */
    for (int64_t l = 0; l < L; l++) wsb = block_ws_bytes(blocks + l, M) > wsb ? block_ws_bytes(blocks + l, M) : wsb;
    const size_t bytes = sizeof(float) * ((size_t)(M * (W + H * D)) + att * (size_t)c->nthreads + parts) +
                         sizeof(int64_t) * (size_t)(3 * nc + M + 1) + wsb + 64;
    float *mem = malloc(bytes);
    if (!mem) return -2;
    float *qkv = mem, *attn = qkv + M * W, *scratch = attn + M * H * D, *partials = scratch + att * (size_t)c->nthreads;
    int64_t *plan = (int64_t *)(partials + parts), nc_l = 0;
    block_ws ws;
    block_ws_init(&ws, plan + 3 * nc + M + 1, b0, M);
    int rc = 0;
#pragma omp parallel num_threads((int)c->nthreads)
    {
    int64_t planned = -1;  /* the window `plan` holds (each thread's copy, set alike everywhere) */
    for (int64_t l = 0; l < L; l++) {
        const lowbit_block *b = blocks + l;
        if (b->window != planned) {  /* every thread sees the same blocks: all take this branch alike */
#pragma omp barrier
#pragma omp single
            nc_l = lowbit_paged_attention_plan(M, ctx, b->window, plan);
            planned = b->window;
        }
        block_pre_team(c, b, M, delta, residual, l > 0, cos + b->rope * M * D, sin + b->rope * M * D, qkv, &ws);
        if (lowbit_kv_write_team(qkv + H * D, qkv + (H + Hkv) * D, W, M, Hkv, D, slots, page_size, k_sides + l,
                                 v_sides + l, write_rot)) {  /* a side it does not take: every thread skips alike */
#pragma omp atomic write
            rc = -1;
        }
#pragma omp barrier
        lowbit_paged_attention_team(qkv, W, M, H, Hkv, D, plan, nc_l, tables, toff, page_size, k_sides + l, v_sides + l,
                                    attn_rot, b->sinks, scale, scratch, att, partials, attn);
        block_post_team(c, b, M, attn, residual, delta, &ws);
    }
    }
    free(mem);
    return rc;
}
