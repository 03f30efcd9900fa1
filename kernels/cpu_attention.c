/* Decode attention over the contiguous fp32 cache (models/llama.py KVCache: `lowbit run`, evaluation,
 * generate's loop): one new token per sequence, each at its own position. Writes the token's K/V into
 * the cache, then attends over keys 0..pos (or the last `window` of them) — what the model did with a
 * slice assignment and SDPA, in one call (kernels/cpu_native.py has the measurements).
 *
 * Per (sequence, head): s_j = (q . k_j) * scale, p = softmax(s) (max subtracted, expf), out = sum p_j v_j
 * / sum p_j; fp32, q.k summed in 8 lanes then lanes 0..7 in order. Query head h reads KV head
 * h / (H / Hkv) (grouped-query attention, as SDPA's enable_gqa). A sequence's result depends only on
 * its own inputs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float s = 0.0f;
    for (; d < D; d++) s += a[d] * b[d];
    for (int l = 0; l < 8; l++) s += lanes[l];
    return s;
}

/* q: [B, H, D] with sequence rows sq floats apart (heads D apart); k, v: [B, Hkv, D], rows skv apart;
 * cache k/v of one layer: element (b, h, s, d) at b * cb + h * ch + s * D + d (S slots per head);
 * pos int64 [B]; window <= 0: none → out fp32 [B, H, D] contiguous. Returns 0, or -1 for a position
 * outside the cache, -2 for a failed allocation. */
int lowbit_decode_attention(const float *q, int64_t sq, const float *k, const float *v, int64_t skv, float *cache_k,
                            float *cache_v, int64_t cb, int64_t ch, int64_t B, int64_t H, int64_t Hkv, int64_t S,
                            int64_t D, const int64_t *pos, int64_t window, float scale, float *out, int nthreads) {
    if (H % Hkv) return -1;
    for (int64_t b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= S) return -1;
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t d = 0; d < D; d++) {
                cache_k[b * cb + h * ch + pos[b] * D + d] = k[b * skv + h * D + d];
                cache_v[b * cb + h * ch + pos[b] * D + d] = v[b * skv + h * D + d];
            }
    }
    const int64_t group = H / Hkv;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(| : failed)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H, kvh = h / group;
        const int64_t last = pos[b], first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
        const int64_t n = last - first + 1;
        float *p = malloc(sizeof(float) * (size_t)n);
        if (!p) {
            failed = 1;
            continue;
        }
        const float *qh = q + b * sq + h * D;
        const float *kh = cache_k + b * cb + kvh * ch + first * D, *vh = cache_v + b * cb + kvh * ch + first * D;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            p[j] = dot(qh, kh + j * D, D) * scale;
            mx = p[j] > mx ? p[j] : mx;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            p[j] = expf(p[j] - mx);
            sum += p[j];
        }
        float *o = out + (b * H + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            int64_t d = 0;
            for (; d + 8 <= D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pj, _mm256_loadu_ps(vh + j * D + d), _mm256_loadu_ps(o + d)));
            for (; d < D; d++) o[d] += p[j] * vh[j * D + d];
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
        free(p);
    }
    return failed ? -2 : 0;
}

#else
int lowbit_decode_attention(void) { return -1; }
#endif
