/* Gated DeltaNet's token-by-token step on the CPU (Qwen3.5's linear-attention layers, models/deltanet.py): the
 * decode step and short chunks of one sequence, in place of kernels/gated_delta.py's torch spec, which costs
 * ~0.8 ms a layer and token at Qwen3.5-4B's shapes (32 value heads of 128 x 128; ~20 small torch ops and three
 * passes over the 2 MiB state).
 *
 * Two exports, called one after the other for a sequence's T new tokens:
 *   lowbit_gated_delta_prep: the short causal conv over the sequence's conv state, SiLU, and q/k made ready
 *       (L2-normalised, q times Dk^-1/2, each key head copied to the value heads it serves) — causal_conv_ref
 *       then prepare_qk;
 *   lowbit_gated_delta_rule: the delta rule over the state [Hv, Dk, Dv], token by token — delta_rule_ref.
 * The rule is a separate export because a speculative chunk's rejected drafts are taken back out of the state
 * by replaying the kept tokens from the journaled q, k, v (runtime/engine/state_cache.py keep), which must be
 * the same arithmetic as the run.
 *
 * Arithmetic: the spec's operations in the spec's order per element (decay, then S^T k, the correction, the
 * write, then S^T q), but the dot products over Dk accumulate in a fixed i order where torch's bmm picks its
 * own, so the results equal the spec within fp32 rounding, not bit for bit (tests/test_gated_delta_cpu.py
 * bounds it: ≤ 1e-5 of the largest output over 64 tokens, measured ~1e-7). Each is the same bits at every call:
 * a token's step does not depend on how many tokens the call has, so decoding one at a time and a speculative
 * chunk of k + 1 give the same state.
 *
 * Memory: a head's state (128 x 128 fp32 = 64 KiB) is read twice per token — once decayed with S^T k, once
 * written with S^T q — the second pass from L2, so each token streams the layer's state from memory once each
 * way (2 MiB in, 2 MiB out at Qwen3.5-4B's shapes). Heads run in parallel (OpenMP), each on its own state. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define MAX_DIM 1024  /* a head's Dk or Dv (Qwen3.5: 128) */

int lowbit_gated_delta_prep(const float *raw, int64_t T, float *conv, const float *conv_w, int64_t K, int64_t Hk,
                            int64_t Hv, int64_t Dk, int64_t Dv, int tiled, float l2_eps, float *q, float *k,
                            float *v) {
    const int64_t C = 2 * Hk * Dk + Hv * Dv, taps = K - 1, r = Hv / Hk;
    if (K < 1 || K > 16 || Hk < 1 || Hv % Hk || Dk > MAX_DIM || Dv > MAX_DIM) return 1;
    /* x: the conv's outputs, ones: for the SiLU (2 C floats: 64 KiB at Qwen3.5-4B's 8192 channels, under malloc's
     * mmap threshold, so a decode step takes no page faults) */
    float *x = malloc(sizeof(float) * (size_t)(2 * C)), *ones = x + C;
    if (!x) return 2;
    for (int64_t c = 0; c < C; c++) ones[c] = 1.0f;
    const float scale = 1.0f / sqrtf((float)Dk);
    for (int64_t t = 0; t < T; t++) {
        const float *in = raw + t * C;
        /* the conv: window = the K - 1 carried inputs (oldest first) and this one, times the channel's taps, summed
         * from the oldest as causal_conv_ref's window; then the carried inputs move up by one */
        for (int64_t c = 0; c < C; c++) {
            float *s = conv + c * taps;
            const float *w = conv_w + c * K;
            float y = 0.0f;
            for (int64_t j = 0; j < taps; j++) y += s[j] * w[j];
            y += in[c] * w[taps];
            for (int64_t j = 0; j + 1 < taps; j++) s[j] = s[j + 1];
            if (taps) s[taps - 1] = in[c];
            x[c] = y;
        }
        /* SiLU as lowbit's silu_mul computes it (cpu_block.c: exp8, 8 lanes at a time), times 1: libm's scalar
         * expf was 0.12 ms of a 0.13 ms token at Qwen3.5-4B's 8192 channels */
        lowbit_gated_mul_n(x, ones, C, x, 0);
        /* q, k per key head: times rsqrt(sum of squares + eps), q also times Dk^-1/2, as prepare_qk */
        for (int64_t h = 0; h < Hk; h++) {
            float *qh = x + h * Dk, *kh = x + Hk * Dk + h * Dk;
            float sq = 0.0f, sk = 0.0f;
            for (int64_t i = 0; i < Dk; i++) {
                sq += qh[i] * qh[i];
                sk += kh[i] * kh[i];
            }
            const float rq = 1.0f / sqrtf(sq + l2_eps), rk = 1.0f / sqrtf(sk + l2_eps);
            for (int64_t i = 0; i < Dk; i++) {
                qh[i] = qh[i] * rq * scale;
                kh[i] = kh[i] * rk;
            }
        }
        /* value head j reads key head j % Hk (tiled, llama.cpp's order) or j / r (grouped, HF's) */
        for (int64_t j = 0; j < Hv; j++) {
            const int64_t h = tiled ? j % Hk : j / r;
            memcpy(q + (t * Hv + j) * Dk, x + h * Dk, sizeof(float) * (size_t)Dk);
            memcpy(k + (t * Hv + j) * Dk, x + Hk * Dk + h * Dk, sizeof(float) * (size_t)Dk);
        }
        memcpy(v + t * Hv * Dv, x + 2 * Hk * Dk, sizeof(float) * (size_t)(Hv * Dv));
    }
    free(x);
    return 0;
}

int lowbit_gated_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta,
                            int64_t T, int64_t H, int64_t Dk, int64_t Dv, float *state, float *out) {
    if (Dk > MAX_DIM || Dv > MAX_DIM) return 1;
#pragma omp parallel for schedule(static) if (H * Dk * Dv >= 65536)
    for (int64_t h = 0; h < H; h++) {
        float *S = state + h * Dk * Dv;
        float kv[MAX_DIM], u[MAX_DIM];
        for (int64_t t = 0; t < T; t++) {
            const float *qt = q + (t * H + h) * Dk, *kt = k + (t * H + h) * Dk, *vt = v + (t * H + h) * Dv;
            const float decay = expf(g[t * H + h]), b = beta[t * H + h];
            float *o = out + (t * H + h) * Dv;
            for (int64_t j = 0; j < Dv; j++) kv[j] = 0.0f;
            for (int64_t i = 0; i < Dk; i++) {  /* S <- exp(g) S; kv = S^T k */
                float *row = S + i * Dv;
                const float ki = kt[i];
                for (int64_t j = 0; j < Dv; j++) {
                    row[j] *= decay;
                    kv[j] += ki * row[j];
                }
            }
            for (int64_t j = 0; j < Dv; j++) {
                u[j] = (vt[j] - kv[j]) * b;  /* the correction, times the rate */
                o[j] = 0.0f;
            }
            for (int64_t i = 0; i < Dk; i++) {  /* S <- S + k u^T; o = S^T q */
                float *row = S + i * Dv;
                const float ki = kt[i], qi = qt[i];
                for (int64_t j = 0; j < Dv; j++) {
                    row[j] += ki * u[j];
                    o[j] += qi * row[j];
                }
            }
        }
    }
    return 0;
}
