/* A mixture-of-experts MLP's experts in one call (models/moe.py; kernels/cpu_moe.py binds it):
 *
 *   out[t] = sum over t's k chosen experts e, ascending e, of w[t, e] * (down_e(act(gate_up_e(x[t]))))
 *
 * with act SiLU-gated (Qwen3-MoE) or gpt-oss's clamped SwiGLU. lowbit_moe_experts takes each row's k expert
 * ids and fp32 weights (Experts.route, which runs cpu_router.c); lowbit_moe_team, inside the fused decode
 * block, routes with cpu_router.c itself.
 *
 * Why: models/moe.py ran a token's k experts one QuantLinear call at a time — gate+up, activation, down,
 * multiply, add: ~6 calls and their Python per expert, 8 experts x 48 layers a token at Qwen3-30B-A3B's
 * size, which took a decode token to 0.67x llama.cpp on the same file. Here the k experts of a decode
 * row (or every expert a prompt step uses) run in one OpenMP team with four barriers, not one
 * region per matmul: each phase shares the tiles of *all* the step's experts out at once (8 experts x
 * 96 tiles of gate+up at 30B-A3B: 768 tiles over the threads), so no thread waits on one small matrix.
 *
 * Bits: every piece is the per-expert path's own — each (row, expert) pair's input quantized as
 * lowbit_linear_mm quantizes it, the same tile kernels (lowbit_linear_tiles; a row's result does not
 * depend on the tile split or on the other rows), bias added once in fp32 as QuantLinear adds it, the
 * activation's row loop the op-by-op path calls (cpu_block.c gated_mul_n for SiLU, swiglu_clamped_n
 * below, which kernels/swiglu_clamped.py calls), then y * w added into a zeroed fp32 row in ascending
 * expert order — so a row here equals the per-expert path's bit for bit, at any M and any grouping
 * (tests/test_moe.py).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* out[0..n) = min(g, limit) * sigmoid(alpha min(g, limit)) * (clamp(u, -limit, limit) + 1), 8 at a time,
 * the tail through the same lanes (so a value's arithmetic is the same wherever it falls): sigmoid(a) as
 * 1 / (1 + exp(-a)) with cpu_kernels.h's exp8. The clamps take g or u as min/max's second operand, which
 * is what the instructions return for a NaN, so NaN passes through as in torch's clamp. */
static void swiglu_clamped_n(const float *g, const float *u, int64_t n, float *out, float alpha, float limit) {
    const __m256 one = _mm256_set1_ps(1.0f), va = _mm256_set1_ps(alpha), hi = _mm256_set1_ps(limit),
                 lo = _mm256_set1_ps(-limit), neg = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_min_ps(hi, _mm256_loadu_ps(g + i));
        const __m256 uv = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(u + i)));
        const __m256 e = exp8(_mm256_xor_ps(_mm256_mul_ps(gv, va), neg));
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_add_ps(uv, one)));
    }
    if (i < n) {
        float gt[8] = {0}, ut[8] = {0}, ot[8];
        for (int64_t j = 0; i + j < n; j++) gt[j] = g[i + j], ut[j] = u[i + j];
        swiglu_clamped_n(gt, ut, 8, ot, alpha, limit);
        for (int64_t j = 0; i + j < n; j++) out[i + j] = ot[j];
    }
}

/* The op-by-op path's loop (kernels/swiglu_clamped.py): out [M, I] from gate and up rows sg and su floats
 * apart. Rows on OpenMP's threads only when there are many (a decode row: one thread, as cpu_block.c's). */
void lowbit_swiglu_clamped(const float *gate, int64_t sg, const float *up, int64_t su, int64_t M, int64_t I,
                           float *out, float alpha, float limit) {
#pragma omp parallel for schedule(static) if (M * I >= 65536)
    for (int64_t m = 0; m < M; m++) swiglu_clamped_n(gate + m * sg, up + m * su, I, out + m * I, alpha, limit);
}

/* One (row, expert) pair's activation over a block of 32 columns → act. */
static inline void act_block(const lowbit_moe *m, const float *gu, int64_t k0, float *act) {
    const float *g = gu + k0, *u = gu + m->hidden + k0;
    if (m->act == 2)
        swiglu_clamped_n(g, u, LOWBIT_BLOCK, act, m->alpha, m->limit);
    else
        lowbit_gated_mul_n(g, u, LOWBIT_BLOCK, act, 0);
}

int lowbit_moe_check(const lowbit_ctx *c, const lowbit_moe *m) {
    if (m->n_experts < 1 || m->dim % LOWBIT_BLOCK || m->hidden % LOWBIT_BLOCK || (m->act != 0 && m->act != 2) ||
        !m->gate_up || !m->down)
        return -1;
    for (int64_t e = 0; e < m->n_experts; e++) {
        const lowbit_linear *gu = m->gate_up + e, *d = m->down + e;
        /* kind 3 (the file's GGML blocks) splits by rows in its own team function: not here */
        if (gu->kind == 3 || d->kind == 3 || lowbit_linear_check(gu, c->isa) || lowbit_linear_check(d, c->isa) ||
            lowbit_linear_rows(gu) != 2 * m->hidden || gu->K != m->dim || lowbit_linear_rows(d) != m->dim ||
            d->K != m->hidden)
            return -1;
    }
    return 0;
}

/* A call's scratch, laid out alike by every thread from (m, M, k): the pairs' grouping (off [E + 1] and a
 * fill cursor [E], tok [P], at [P]), the routing (ids, w [M, k], logits and p [M, E]; a caller's own ids and
 * w replace the first two), the pairs' gate+up outputs gu [P, 2 hidden] and down outputs y [P, dim], and their
 * quantized inputs qx [P, dim], qa [P, hidden]. P = M k. */
typedef struct {
    int64_t *off, *tok, *at, *ids;
    float *w, *logits, *p, *gu, *y;
    lowbit_qact qx, qa;
} moe_ws;

size_t lowbit_moe_scratch(const lowbit_moe *m, int64_t M, int64_t k) {
    const int64_t P = M * k, E = m->n_experts;
    return sizeof(int64_t) * (size_t)(3 * P + 2 * (E + 1)) + sizeof(float) * (size_t)(P + 2 * M * E) +
           sizeof(float) * (size_t)(P * (2 * m->hidden + m->dim)) + lowbit_qact_bytes(P, m->dim) +
           lowbit_qact_bytes(P, m->hidden) + 4 * 64;
}

static inline void *after(void *p, size_t bytes) { return (void *)(((uintptr_t)p + bytes + 63) & ~(uintptr_t)63); }

static void moe_ws_init(moe_ws *ws, void *mem, const lowbit_moe *m, int64_t M, int64_t k) {
    const int64_t P = M * k, E = m->n_experts;
    ws->off = mem, ws->tok = ws->off + 2 * (E + 1), ws->at = ws->tok + P, ws->ids = ws->at + P;
    ws->w = (float *)(ws->ids + P), ws->logits = ws->w + P, ws->p = ws->logits + M * E;
    ws->gu = after(ws->p + M * E, 0), ws->y = ws->gu + P * 2 * m->hidden;
    void *q = after(ws->y + P * m->dim, 0);
    lowbit_qact_init(&ws->qx, q, P, m->dim);
    lowbit_qact_init(&ws->qa, after(q, lowbit_qact_bytes(P, m->dim)), P, m->hidden);
}

/* The step's pairs grouped by expert: off [E + 1] (expert e's pairs are off[e]..off[e + 1]), tok [P] each
 * pair's row, at [P] where pair (t, j) of ids went. Tokens ascend within an expert (a counting sort), as
 * the per-expert path gathers them. Returns -1 for an id outside 0..E-1 or twice in one row. */
static int group_pairs(const int64_t *ids, int64_t M, int64_t k, int64_t E, int64_t *off, int64_t *tok, int64_t *at) {
    memset(off, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t t = 0; t < M; t++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = ids[t * k + j];
            if (e < 0 || e >= E) return -1;
            for (int64_t i = 0; i < j; i++)
                if (ids[t * k + i] == e) return -1;
            off[e + 1]++;
        }
    for (int64_t e = 0; e < E; e++) off[e + 1] += off[e];
    int64_t *fill = off + E + 1;  /* [E] next free pair of each expert (scratch after off) */
    memcpy(fill, off, sizeof(int64_t) * (size_t)E);
    for (int64_t t = 0; t < M; t++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t p = fill[ids[t * k + j]]++;
            tok[p] = t, at[t * k + j] = p;
        }
    return 0;
}

/* One weight per used expert (w[e], rows off[e]..off[e + 1] of a and y): this thread's share of all their
 * tiles. A tile of expert e costs its rows plus 4 (reading it: ~ the time of 4 rows' integer sums at
 * decode sizes), so a prompt step whose experts hold unequal numbers of rows still splits evenly. */
static void experts_tiles(const lowbit_ctx *c, const lowbit_linear *w, const int64_t *off, int64_t E,
                          const lowbit_qact *a, float *y, int64_t ldy) {
    int64_t W = 0;
    for (int64_t e = 0; e < E; e++) W += (off[e + 1] - off[e] ? off[e + 1] - off[e] + 4 : 0) * (ldy / LOWBIT_TILE);
    const int64_t n = omp_get_num_threads(), i = omp_get_thread_num(), b0 = W * i / n, b1 = W * (i + 1) / n;
    int64_t cum = 0;
    for (int64_t e = 0; e < E && cum < b1; e++) {
        const int64_t rows = off[e + 1] - off[e], T = ldy / LOWBIT_TILE, cost = rows + 4;
        if (!rows) continue;
        /* tile t of e is this thread's when its start cum + t cost falls in [b0, b1) */
        const int64_t t0 = b0 <= cum ? 0 : (b0 - cum + cost - 1) / cost, t1e = (b1 - cum + cost - 1) / cost;
        const int64_t t1 = t1e < T ? t1e : T;
        cum += cost * T;
        if (t1 <= t0) continue;
        lowbit_qact v = *a;  /* the expert's rows of a */
        v.M = rows, v.hl += 2 * off[e] * a->K, v.q += off[e] * a->K, v.blk += off[e] * a->nb;
        lowbit_linear_tiles(c, w + e, &v, t0, t1, y + off[e] * ldy);
    }
#pragma omp barrier
}

/* A team function (every thread of the region calls it): the experts of M rows, x [M, dim] → out [M, dim],
 * for the routing ids int64 / wts fp32 [M, k], the pairs already grouped into ws (group_pairs). */
static void moe_team(const lowbit_ctx *c, const lowbit_moe *m, int64_t M, const float *x, int64_t k, const float *wts,
                     const int64_t *ids, float *out, moe_ws *ws) {
    const int64_t *off = ws->off, *tok = ws->tok, *at = ws->at;
    float *gu = ws->gu, *y = ws->y;
    lowbit_qact *qx = &ws->qx, *qa = &ws->qa;
    const int64_t P = M * k, E = m->n_experts, I = m->hidden, dim = m->dim;
    /* each pair's input row, quantized as its expert's own call would (rows are independent) */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; p++)
        for (int64_t b = 0; b < qx->nb; b++) lowbit_quantize_block(x + tok[p] * dim + b * LOWBIT_BLOCK, qx, p, b);
    experts_tiles(c, m->gate_up, off, E, qx, gu, 2 * I);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < P * qa->nb; i++) {
        const int64_t p = i / qa->nb, b = i % qa->nb;
        float act[LOWBIT_BLOCK];
        act_block(m, gu + p * 2 * I, b * LOWBIT_BLOCK, act);
        lowbit_quantize_block(act, qa, p, b);
    }
    experts_tiles(c, m->down, off, E, qa, y, dim);
    /* each row's experts in ascending id: out = ((0 + y_e1 w_1) + y_e2 w_2) + ..., the per-expert path's
     * zeroed row and index_add_ order (explicit mul then add: no FMA, as torch's two ops round) */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++) {
        float *o = out + t * dim;
        memset(o, 0, sizeof(float) * (size_t)dim);
        int64_t last = -1;
        for (int64_t n = 0; n < k; n++) {
            int64_t j = -1;  /* the slot with the smallest id above the last one's (k <= ~32: a scan) */
            for (int64_t s = 0; s < k; s++)
                if (ids[t * k + s] > last && (j < 0 || ids[t * k + s] < ids[t * k + j])) j = s;
            last = ids[t * k + j];
            const float *yr = y + at[t * k + j] * dim;
            const __m256 wv = _mm256_set1_ps(wts[t * k + j]);
            int64_t d = 0;
            for (; d + 8 <= dim; d += 8)
                _mm256_storeu_ps(o + d, _mm256_add_ps(_mm256_loadu_ps(o + d), _mm256_mul_ps(_mm256_loadu_ps(yr + d), wv)));
            for (; d < dim; d++) o[d] = o[d] + yr[d] * wts[t * k + j];
        }
    }
}

/* x fp32 [M, dim] (the normed rows), ids int64 [M, k] (each row's experts, distinct), wts fp32 [M, k] →
 * out fp32 [M, dim]. Returns 0, -1 for shapes, layouts or ids it does not take, -2 for a failed
 * allocation. */
int lowbit_moe_experts(const lowbit_ctx *c, const lowbit_moe *m, int64_t M, const float *x, int64_t k,
                       const int64_t *ids, const float *wts, float *out) {
    if (M < 1 || k < 1 || k > m->n_experts || lowbit_moe_check(c, m)) return -1;
    void *mem = malloc(lowbit_moe_scratch(m, M, k));
    if (!mem) return -2;
    moe_ws ws;
    moe_ws_init(&ws, mem, m, M, k);
    if (group_pairs(ids, M, k, m->n_experts, ws.off, ws.tok, ws.at)) {
        free(mem);
        return -1;
    }
#pragma omp parallel num_threads((int)c->nthreads)
    moe_team(c, m, M, x, k, wts, ids, out, &ws);
    free(mem);
    return 0;
}

/* The whole MoE as a team function (cpu_block.c): the router (cpu_router.c), the pairs grouped on one
 * thread (M k of them: 8 at decode), then the experts. mem: lowbit_moe_scratch(m, M, m->k) bytes; the
 * descriptor checked by the caller (lowbit_moe_check with a router). */
void lowbit_moe_team(const lowbit_ctx *c, const lowbit_moe *m, int64_t M, const float *x, float *out, void *mem) {
    moe_ws ws;
    moe_ws_init(&ws, mem, m, M, m->k);
    lowbit_route_team(m, M, x, ws.logits, ws.p, ws.ids, ws.w);
#pragma omp single
    group_pairs(ws.ids, M, m->k, m->n_experts, ws.off, ws.tok, ws.at);  /* the router's ids: always valid */
    moe_team(c, m, M, x, m->k, ws.w, ws.ids, out, &ws);
}
