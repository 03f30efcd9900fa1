/* A mixture of experts' router on CPU (models/moe.py Experts.route; cpu_moe.c runs it inside the one-call
 * experts and the fused decode block): per row, logits = R x (+ b) over the E experts, then the family's rule
 *
 *   softmax (Qwen3-MoE):      p = softmax(logits) over all E, the k largest p, divided by their sum (norm_topk)
 *   topk_softmax (gpt-oss):   the k largest logits, softmax over those k
 *
 * Why in C: the fused decode step (cpu_block.c) runs a whole MoE layer in one parallel region, and the op-by-op
 * path must choose the same experts with the same weights bit for bit, so both call this code. A logit is an
 * fp32 dot in one fixed order (4 accumulators of 8 lanes over the row, (a0 + a1) + (a2 + a3), lanes 0..7 in
 * order, then the tail), so a row's choice does not depend on M, the thread that computes it, or the ISA the
 * matmuls run on (this file has one build). It differs from the exact path's oneDNN GEMM by fp32 rounding only
 * (~1e-7 of a logit); a choice can then differ from transformers' only where two experts tie to that precision.
 *
 * Ties: top k takes the larger value first and, among equal values, the lower expert id (torch.topk leaves its
 * order on ties unspecified). The exponentials are libm's expf (one build, so the same bits everywhere the
 * library runs); the sums run in slot order (the k chosen, largest first) or expert order (the softmax over E).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

static float dot(const float *a, const float *b, int64_t n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j), acc[j]);
    for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    float s = lanes[0];
    for (int l = 1; l < 8; l++) s += lanes[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Team: logits [M, E] of every row, the (row, expert) dots shared out (a decode row's 128 x 2048 at 30B-A3B
 * is ~0.26 M multiply-adds: both threads take half). */
void lowbit_route_logits_team(const lowbit_moe *m, int64_t M, const float *x, float *logits) {
    const int64_t E = m->n_experts;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * E; i++) {
        const int64_t r = i / E, e = i % E;
        logits[i] = dot(m->router + e * m->dim, x + r * m->dim, m->dim) + (m->router_bias ? m->router_bias[e] : 0.0f);
    }
}

/* One row's logits [E] → its k expert ids (largest first; ties: the lower id) and weights. p: scratch [E]. */
void lowbit_route_row(const lowbit_moe *m, const float *logits, float *p, int64_t *ids, float *w) {
    const int64_t E = m->n_experts, k = m->k;
    const float *v = logits;
    if (m->rule == 0) {  /* softmax over all E first */
        float mx = logits[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(logits[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
        v = p;
    }
    for (int64_t s = 0; s < k; s++) {  /* k <= E passes (8 x 128 at 30B-A3B): no sort needed */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t t = 0; t < s; t++) taken |= ids[t] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        ids[s] = best, w[s] = v[best];
    }
    if (m->rule == 1) {  /* softmax over the k chosen logits */
        float sum = 0.0f;
        const float mx = w[0];
        for (int64_t s = 0; s < k; s++) sum += w[s] = expf(w[s] - mx);
        for (int64_t s = 0; s < k; s++) w[s] = w[s] / sum;
    } else if (m->norm_topk) {
        float sum = 0.0f;
        for (int64_t s = 0; s < k; s++) sum += w[s];
        for (int64_t s = 0; s < k; s++) w[s] = w[s] / sum;
    }
}

/* Team: x [M, dim] → ids int64 [M, k], w fp32 [M, k]; scratch: logits [M, E] and p [M, E]. */
void lowbit_route_team(const lowbit_moe *m, int64_t M, const float *x, float *logits, float *p, int64_t *ids, float *w) {
    lowbit_route_logits_team(m, M, x, logits);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++)
        lowbit_route_row(m, logits + r * m->n_experts, p + r * m->n_experts, ids + r * m->k, w + r * m->k);
}

/* Standalone (models/moe.py Experts.route, the op-by-op path): x fp32 [M, dim] → ids int64 [M, k], w fp32
 * [M, k]. Returns 0, -1 for a descriptor without a router, -2 for a failed allocation. */
int lowbit_moe_route(const lowbit_ctx *c, const lowbit_moe *m, int64_t M, const float *x, int64_t *ids, float *w) {
    if (M < 1 || !m->router || m->k < 1 || m->k > m->n_experts || m->rule < 0 || m->rule > 1) return -1;
    float *logits = malloc(sizeof(float) * (size_t)(2 * M * m->n_experts));
    if (!logits) return -2;
#pragma omp parallel num_threads((int)c->nthreads)
    lowbit_route_team(m, M, x, logits, logits + M * m->n_experts, ids, w);
    free(logits);
    return 0;
}
