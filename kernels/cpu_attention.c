/* Attention over the engine's paged pool (runtime/engine/kv_cache.py) and the quantize-on-write
 * that fills it: decode attention straight from the pages of every format (fp32, fp16, 8-bit and
 * 4-bit codes), one query row per token, each row's result depending only on its own inputs; and the
 * K/V of a step written into their slots with kernels/kv_quant.py's arithmetic (kernels/cpu_native.py
 * binds both, models/attention.py calls them).
 *
 * Per (row, head): s_j = (q . k_j) * scale, p = softmax(s) (max subtracted, expf), out = sum p_j v_j
 * / sum p_j, fp32. Query head h reads KV head h / (H / Hkv) (grouped-query attention, as SDPA's
 * enable_gqa). With attention sinks (gpt-oss: a learned logit per query head, sinks[h]), the sink
 * joins the softmax but carries no value: out = sum exp(s_j) v_j / (exp(sinks[h]) + sum exp(s_j)).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#include <immintrin.h>

/* The sum of 8 lanes, in a fixed tree. */
static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

/* The sums of 8 vectors' lanes: lane u of the result is the sum of v[u] (a fixed tree of hadds). */
static inline __m256 hsum8x8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), e = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), ce = _mm256_hadd_ps(c, e);  /* per 128-bit lane: v0..v3 | v4..v7 halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, ce, 0x20), _mm256_permute2f128_ps(ab, ce, 0x31));
}

/* p[i] = exp(p[i] - mx) for i < n, in place → their sum (8 lanes, then lanes in a fixed tree, then
 * the tail). */
static inline float exp_sum(float *p, int64_t n, float mx) {
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
        _mm256_storeu_ps(p + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (i < n) {  /* the last 1..7 through the same polynomial, padded with -inf's exp(0 -> clamp) and cut */
        float tail[8];
        for (int k = 0; k < 8; k++) tail[k] = i + k < n ? p[i + k] : mx - 1000.0f;
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), vm));
        _mm256_storeu_ps(tail, e);
        for (int64_t k = 0; i + k < n; k++) p[i + k] = tail[k];
        acc = _mm256_add_ps(acc, _mm256_blendv_ps(_mm256_setzero_ps(), e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32((int)(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
    }
    return hsum8(acc);
}


/* 16 4-bit codes (8 bytes, value k in byte k/2, low nibble first) → values 0-7 and 8-15 as floats. */
static inline void u4x16(const uint8_t *c, __m256 *lo8, __m256 *hi8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(b, 4);
    const __m256i a = _mm256_unpacklo_epi32(lo, hi), e = _mm256_unpackhi_epi32(lo, hi);  /* [0-3 | 8-11], [4-7 | 12-15] */
    *lo8 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, e, 0x20));
    *hi8 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, e, 0x31));
}

/* Where token t of a sequence (page ids `table`) keeps head h's vector in a side: the page-major index
 * (page * Hkv + h) * page_size + slot. */
static inline int64_t kv_token(const int64_t *table, int64_t page_size, int64_t Hkv, int64_t h, int64_t t) {
    return (table[t / page_size] * Hkv + h) * page_size + t % page_size;
}

/* Token vector `t` (page-major index (page * Hkv + h) * page_size + slot) of one side, without its
 * scales: x[D] = the 8-bit codes, the 4-bit codes u, or the fp16 / fp32 values, as floats; d[G], m[G]
 * the scale and min of each group of the vector (8-bit: m = 0; 16- and 32-bit: one group, d = 1, m = 0)
 * → G.
 * Attention multiplies the scales in once per group (scores d * (q . c) + m * sum q, values
 * (p d) u + p m) rather than once per value. */
static inline int64_t kv_codes(const lowbit_kv_side *s, int64_t t, int64_t D, float *x, float *d, float *m) {
    if (s->bits == 32) {  /* the values as stored: x = data, exactly */
        const float *f = (const float *)s->codes + t * D;
        for (int64_t k = 0; k + 8 <= D; k += 8) _mm256_storeu_ps(x + k, _mm256_loadu_ps(f + k));
        d[0] = 1.0f, m[0] = 0.0f;
        return 1;
    }
    if (s->bits == 16) {
        const uint16_t *h = (const uint16_t *)s->codes + t * D;
        for (int64_t k = 0; k + 8 <= D; k += 8)
            _mm256_storeu_ps(x + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + k))));
        d[0] = 1.0f, m[0] = 0.0f;
        return 1;
    }
    const int64_t G = D / s->group;
    for (int64_t g = 0; g < G; g++) {
        d[g] = _cvtsh_ss(s->scales[t * G + g]);
        m[g] = s->bits == 4 ? _cvtsh_ss(s->mins[t * G + g]) : 0.0f;
    }
    if (s->bits == 8) {
        const int8_t *c = (const int8_t *)s->codes + t * D;
        for (int64_t k = 0; k < D; k += 8)
            _mm256_storeu_ps(x + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + k)))));
        return G;
    }
    const uint8_t *c = (const uint8_t *)s->codes + t * D / 2;
    for (int64_t k = 0; k < D; k += 16) {
        __m256 lo8, hi8;
        u4x16(c + k / 2, &lo8, &hi8);
        _mm256_storeu_ps(x + k, lo8);
        _mm256_storeu_ps(x + k + 8, hi8);
    }
    return G;
}

/* The KV rotation R = diag(s) H / sqrt(D) (kernels/kv_quant.py rotation: H the Sylvester Hadamard,
 * D a power of 2), given by its D signs s: y[D] = x @ R = FWHT(s * x) / sqrt(D), or x @ R^T =
 * s * FWHT(x) / sqrt(D) (transposed). The fast Walsh-Hadamard transform takes D log2 D adds where
 * the product took D^2 multiply-adds (64: 384 against 4096; a 16-row decode step spent 8% of its time
 * in these products). */
static void rotate(const float *x, const float *signs, int64_t D, int transposed, float *y) {
    for (int64_t i = 0; i < D; i++) y[i] = transposed ? x[i] : x[i] * signs[i];
    for (int64_t h = 1; h < D; h *= 2)
        for (int64_t i = 0; i < D; i += 2 * h)
            for (int64_t k = i; k < i + h; k++) {
                const float a = y[k], b = y[k + h];
                y[k] = a + b;
                y[k + h] = a - b;
            }
    const float scale = 1.0f / sqrtf((float)D);  /* 1/8 for D = 64: exact */
    for (int64_t i = 0; i < D; i++) y[i] = transposed ? y[i] * scale * signs[i] : y[i] * scale;
}

/* Into L1 ahead of use: the cache lines of [p, p + bytes). */
static inline void prefetch_range(const void *p, int64_t bytes) {
    const uintptr_t a = (uintptr_t)p & ~(uintptr_t)63, e = (uintptr_t)p + (uintptr_t)bytes;
    for (uintptr_t l = a; l < e; l += 64) _mm_prefetch((const char *)l, _MM_HINT_T0);
}

/* Tokens t..t+n-1 of one KV head, all in one page (their index `t` is page-major, so they are
 * adjacent): codes, scales and mins. */
static inline void kv_prefetch(const lowbit_kv_side *s, int64_t t, int64_t n, int64_t D) {
    const int64_t bytes = s->bits * D / 8, G = s->bits >= 16 ? 0 : D / s->group;
    prefetch_range((const char *)s->codes + t * bytes, n * bytes);
    if (G) prefetch_range(s->scales + t * G, 2 * n * G);
    if (G && s->bits == 4) prefetch_range(s->mins + t * G, 2 * n * G);
}

/* Tokens a chunk's score loop asks for ahead of the one it reads (keys and values, page by page). A
 * page holds one KV head's vectors of page_size tokens together, then the other heads': runs of 1 KB
 * (k8, 16 tokens of 64) that the hardware prefetchers hardly start on, so without this the loop waited
 * on memory (perf: most of its samples on the loads of codes and scales). */
#define KV_AHEAD 32

/* The values of one chunk (tokens first..last of KV head kvh) for its grp query heads, from 4-bit codes
 * in groups of a multiple of 16: per head j, o_j += (p d) u per group and ms_j += p m, 2 tokens a pass —
 * the general loop's arithmetic in its order (the same bits), the codes turned into floats in registers
 * once for all grp heads instead of through a buffer. p: [grp][n] the chunk's exp-scores; o [grp, D],
 * ms [grp, G] accumulate. */
static void v4_values(const lowbit_kv_side *vs, const int64_t *table, int64_t page_size, int64_t Hkv, int64_t kvh,
                      int64_t first, int64_t last, int64_t D, int64_t grp, const float *p, float *o, float *ms) {
    const int64_t n = last - first + 1, G = D / vs->group, gv = vs->group;
    for (int64_t t = first; t <= last; t += 2) {
        const int two = t + 1 <= last;
        const int64_t i0 = kv_token(table, page_size, Hkv, kvh, t);
        const int64_t i1 = two ? kv_token(table, page_size, Hkv, kvh, t + 1) : i0;
        const uint8_t *c0 = (const uint8_t *)vs->codes + i0 * D / 2, *c1 = (const uint8_t *)vs->codes + i1 * D / 2;
        for (int64_t g = 0; g < G; g++) {
            const float d0 = _cvtsh_ss(vs->scales[i0 * G + g]), m0 = _cvtsh_ss(vs->mins[i0 * G + g]);
            const float d1 = _cvtsh_ss(vs->scales[i1 * G + g]), m1 = _cvtsh_ss(vs->mins[i1 * G + g]);
            for (int64_t k = g * gv; k < (g + 1) * gv; k += 16) {
                __m256 x0a, x0b, x1a, x1b;
                u4x16(c0 + k / 2, &x0a, &x0b);
                u4x16(c1 + k / 2, &x1a, &x1b);
                for (int64_t j = 0; j < grp; j++) {
                    const float p0 = p[j * n + t - first], p1 = two ? p[j * n + t + 1 - first] : 0.0f;
                    const __m256 w0 = _mm256_set1_ps(p0 * d0), w1 = _mm256_set1_ps(two ? p1 * d1 : 0.0f);
                    float *oj = o + j * D + k;
                    __m256 a = _mm256_fmadd_ps(w0, x0a, _mm256_loadu_ps(oj)), b = _mm256_fmadd_ps(w0, x0b, _mm256_loadu_ps(oj + 8));
                    if (two) a = _mm256_fmadd_ps(w1, x1a, a), b = _mm256_fmadd_ps(w1, x1b, b);
                    _mm256_storeu_ps(oj, a);
                    _mm256_storeu_ps(oj + 8, b);
                }
            }
            for (int64_t j = 0; j < grp; j++) {
                const float p0 = p[j * n + t - first], p1 = two ? p[j * n + t + 1 - first] : 0.0f;
                ms[j * G + g] += p0 * m0 + (two ? p1 * m1 : 0.0f);
            }
        }
    }
}

/* Decode attention straight from the paged, quantized pool: R query rows, each one token of its
 * sequence seeing the first ctx[r] >= 1 tokens of it (its own included; the last `window` if window > 0).
 *
 * Work items are (chunk of a row's context, KV head): every row's context is cut into chunks of
 * ATTN_CHUNK tokens (a rule of the row's own length, so its numbers do not depend on the other rows:
 * batch invariance), each item attends its chunk for the H / Hkv query heads that read the KV head —
 * each key and value vector dequantized once for them — and leaves the chunk's unnormalized output,
 * max score and exp-sum; then each (row, head) merges its chunks in order (flash-decoding). One row
 * of the default model (3 KV heads) made 3 items for 2 threads; at 256 tokens it makes 6. */
#define ATTN_CHUNK 128

/* The step's chunks: plan[3c .. 3c+2] = (row, first token, last token) for c < the returned count,
 * then plan[3 nc + r] = row r's first chunk (r <= R). plan NULL: only count. */
int64_t lowbit_paged_attention_plan(int64_t R, const int64_t *ctx, int64_t window, int64_t *plan) {
    int64_t nc = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t last = ctx[r] - 1, first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
        nc += (last - first + ATTN_CHUNK) / ATTN_CHUNK;
    }
    if (!plan) return nc;
    int64_t c = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t last = ctx[r] - 1, first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
        plan[3 * nc + r] = c;
        for (int64_t t = first; t <= last; t += ATTN_CHUNK, c++) {
            plan[3 * c] = r, plan[3 * c + 1] = t;
            plan[3 * c + 2] = t + ATTN_CHUNK - 1 < last ? t + ATTN_CHUNK - 1 : last;
        }
    }
    plan[3 * nc + R] = nc;
    return nc;
}

/* Floats of scratch one thread needs: one chunk's scores for the H / Hkv query heads, their vectors
 * and outputs, 8 key vectors, and per group scales and sums. */
size_t lowbit_paged_attention_scratch(int64_t H, int64_t Hkv, int64_t D) {
    const int64_t grp = H / Hkv;
    return (size_t)(ATTN_CHUNK * grp + (4 * grp + 12) * D + 16);
}

/* Floats the items leave for the merge: per chunk and query head, the output [D], max and exp-sum. */
size_t lowbit_paged_attention_partials(int64_t nchunks, int64_t H, int64_t D) {
    return (size_t)(nchunks * H * (D + 2));
}

/* q [R, H, D] (rows sq floats apart); the plan and chunk count from lowbit_paged_attention_plan; row r's
 * page ids are tables[toff[r] ...]; rot: the pool's rotation, its D signs (`rotate`), or NULL: a quantized
 * side is stored rotated, a float one never (kv_write_one), so q is rotated where the keys are quantized and
 * the output rotated back where the values are (a pool of per-layer formats may have a layer of f16 keys and
 * int4 values: runtime/engine/kv_cache.py); sinks: fp32 [H] attention sinks or NULL →
 * out fp32 [R, H, D]. A team function (items shared out, a barrier, the merges shared out, a barrier);
 * scratch: per_thread floats (lowbit_paged_attention_scratch) for each thread; partials:
 * lowbit_paged_attention_partials floats. */
void lowbit_paged_attention_team(const float *q, int64_t sq, int64_t R, int64_t H, int64_t Hkv, int64_t D,
                                 const int64_t *plan, int64_t nchunks, const int64_t *tables, const int64_t *toff,
                                 int64_t page_size, const lowbit_kv_side *ks, const lowbit_kv_side *vs,
                                 const float *rot, const float *sinks, float scale, float *scratch, size_t per_thread,
                                 float *partials, float *out) {
    const int64_t grp = H / Hkv, GK = ks->bits >= 16 ? 1 : D / ks->group, GV = vs->bits >= 16 ? 1 : D / vs->group;
    const int64_t gk = D / GK, gv = D / GV;
    const float *q_rot = ks->bits < 16 ? rot : NULL, *o_rot = vs->bits < 16 ? rot : NULL;
    float *buf = scratch + per_thread * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < nchunks * Hkv; item++) {
        const int64_t c = item / Hkv, kvh = item % Hkv, r = plan[3 * c], first = plan[3 * c + 1], last = plan[3 * c + 2];
        const int64_t n = last - first + 1;
        float *p = buf, *qr = p + ATTN_CHUNK * grp, *o = qr + grp * D, *x = o + grp * D, *y = x + D;
        float *d = y + D, *m = d + D, *qs = m + D, *ms = qs + grp * D;  /* per group: scale, min; per head and group: sum q, sum p m */
        float *xs = ms + grp * D;  /* 8 key vectors' codes (or a second value vector's) */
        for (int64_t j = 0; j < grp; j++) {
            const float *qh = q + r * sq + (kvh * grp + j) * D;
            if (q_rot) rotate(qh, q_rot, D, 0, qr + j * D);
            else for (int64_t k = 0; k < D; k++) qr[j * D + k] = qh[k];
            for (int64_t g = 0; g < GK; g++) {
                float sum = 0.0f;
                for (int64_t k = 0; k < gk; k++) sum += qr[j * D + g * gk + k];
                qs[j * GK + g] = sum;
            }
        }
        const int64_t *table = tables + toff[r];
#define KV_INDEX(t) kv_token(table, page_size, Hkv, kvh, t)
        int64_t ahead = first;  /* the first token not yet asked for */
        for (int64_t t0 = first; t0 <= last; t0 += 8) {  /* scores, 8 tokens at a time: per group d (q . c) + m sum q */
            const int64_t nt = last - t0 + 1 < 8 ? last - t0 + 1 : 8;
            for (; ahead <= last && ahead < t0 + KV_AHEAD; ) {  /* the rest of ahead's page, up to last */
                const int64_t end = (ahead / page_size + 1) * page_size, n_pf = (end <= last ? end : last + 1) - ahead;
                kv_prefetch(ks, KV_INDEX(ahead), n_pf, D);
                kv_prefetch(vs, KV_INDEX(ahead), n_pf, D);
                ahead += n_pf;
            }
            float dk[8 * 64], mk[8 * 64];  /* [group][token] */
            for (int64_t u = 0; u < nt; u++) {
                float dg[64], mg[64];
                kv_codes(ks, KV_INDEX(t0 + u), D, xs + u * D, dg, mg);
                for (int64_t g = 0; g < GK; g++) dk[g * 8 + u] = dg[g], mk[g * 8 + u] = mg[g];
            }
            for (int64_t u = nt; u < 8; u++) {  /* a short last group of tokens: zeros, their scores unused */
                for (int64_t k = 0; k < D; k++) xs[u * D + k] = 0.0f;
                for (int64_t g = 0; g < GK; g++) dk[g * 8 + u] = mk[g * 8 + u] = 0.0f;
            }
            for (int64_t j = 0; j < grp; j++) {
                __m256 sc = _mm256_setzero_ps();
                for (int64_t g = 0; g < GK; g++) {
                    __m256 acc[8];
                    for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
                    for (int64_t k = g * gk; k < (g + 1) * gk; k += 8) {
                        const __m256 qv = _mm256_loadu_ps(qr + j * D + k);
                        for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(xs + u * D + k), acc[u]);
                    }
                    sc = _mm256_add_ps(sc, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(dk + g * 8), hsum8x8(acc)),
                                                         _mm256_mul_ps(_mm256_loadu_ps(mk + g * 8),
                                                                       _mm256_set1_ps(qs[j * GK + g]))));
                }
                float s8[8];
                _mm256_storeu_ps(s8, _mm256_mul_ps(sc, _mm256_set1_ps(scale)));
                for (int64_t u = 0; u < nt; u++) p[j * n + t0 + u - first] = s8[u];
            }
        }
        float mx[grp], sum[grp];
        for (int64_t j = 0; j < grp; j++) {
            float *pj = p + j * n;
            mx[j] = -INFINITY;
            for (int64_t i = 0; i < n; i++) mx[j] = pj[i] > mx[j] ? pj[i] : mx[j];
            sum[j] = exp_sum(pj, n, mx[j]);
        }
        for (int64_t i = 0; i < grp * D; i++) o[i] = 0.0f;
        for (int64_t i = 0; i < grp * GV; i++) ms[i] = 0.0f;
        if (vs->bits == 4 && gv % 16 == 0) v4_values(vs, table, page_size, Hkv, kvh, first, last, D, grp, p, o, ms);
        else for (int64_t t = first; t <= last; t += 2) {  /* values, 2 tokens a pass over o: o += (p d) u per group, p m aside */
            const int two = t + 1 <= last;
            float d1[64], m1[64];
            kv_codes(vs, KV_INDEX(t), D, x, d, m);
            if (two) kv_codes(vs, KV_INDEX(t + 1), D, xs, d1, m1);
            for (int64_t j = 0; j < grp; j++) {
                const float p0 = p[j * n + t - first], p1 = two ? p[j * n + t + 1 - first] : 0.0f;
                float *oj = o + j * D;
                for (int64_t g = 0; g < GV; g++) {
                    const __m256 c0 = _mm256_set1_ps(p0 * d[g]), c1 = _mm256_set1_ps(two ? p1 * d1[g] : 0.0f);
                    for (int64_t k = g * gv; k < (g + 1) * gv; k += 8) {
                        __m256 acc = _mm256_fmadd_ps(c0, _mm256_loadu_ps(x + k), _mm256_loadu_ps(oj + k));
                        if (two) acc = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xs + k), acc);
                        _mm256_storeu_ps(oj + k, acc);
                    }
                    ms[j * GV + g] += p0 * m[g] + (two ? p1 * m1[g] : 0.0f);
                }
            }
        }
#undef KV_INDEX
        for (int64_t j = 0; j < grp; j++) {  /* the chunk's unnormalized output, max and exp-sum */
            float *part = partials + (c * H + kvh * grp + j) * (D + 2);
            for (int64_t k = 0; k < D; k++) part[k] = o[j * D + k] + ms[j * GV + k / gv];
            part[D] = mx[j], part[D + 1] = sum[j];
        }
    }
    /* (the loop's barrier: every chunk is done) merge each (row, head)'s chunks in order. A sink is the
     * row's, not a chunk's: it joins the max and the denominator here, once per (row, head), so a row
     * cut into 1 or 40 chunks sees it once; without sinks top starts at -inf and nothing else changes. */
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < R * H; rh++) {
        const int64_t r = rh / H, h = rh % H, c0 = plan[3 * nchunks + r], c1 = plan[3 * nchunks + r + 1];
        float *y = buf, *acc = y + D, *dst = out + rh * D;
        float top = sinks ? sinks[h] : -INFINITY, sum = 0.0f;
        for (int64_t c = c0; c < c1; c++) {
            const float mc = partials[(c * H + h) * (D + 2) + D];
            top = mc > top ? mc : top;
        }
        for (int64_t k = 0; k < D; k++) acc[k] = 0.0f;
        for (int64_t c = c0; c < c1; c++) {
            const float *part = partials + (c * H + h) * (D + 2), w = expf(part[D] - top);  /* one chunk: w = 1 */
            for (int64_t k = 0; k < D; k++) acc[k] += w * part[k];
            sum += w * part[D + 1];
        }
        if (sinks) sum += expf(sinks[h] - top);  /* the sink's share of the denominator; it adds no value */
        const float inv = 1.0f / sum;
        for (int64_t k = 0; k < D; k++) acc[k] *= inv;
        if (o_rot) rotate(acc, o_rot, D, 1, y);
        for (int64_t k = 0; k < D; k++) dst[k] = o_rot ? y[k] : acc[k];
    }
}

/* The same in its own parallel region. Returns 0, -1 for bad shapes, -2 for a failed allocation. */
int lowbit_paged_decode_attention(const float *q, int64_t sq, int64_t R, int64_t H, int64_t Hkv, int64_t D,
                                  const int64_t *ctx, const int64_t *tables, const int64_t *toff, int64_t page_size,
                                  const lowbit_kv_side *ks, const lowbit_kv_side *vs, const float *rot,
                                  const float *sinks, int64_t window, float scale, float *out, int nthreads) {
    if (H % Hkv || D % 8 || D > 512) return -1;  /* vector steps of 8; at most 64 groups of 8 per vector */
    for (int64_t r = 0; r < R; r++)
        if (ctx[r] < 1) return -1;
    const int64_t nc = lowbit_paged_attention_plan(R, ctx, window, NULL);
    const size_t per = lowbit_paged_attention_scratch(H, Hkv, D), parts = lowbit_paged_attention_partials(nc, H, D);
    const int nt = nthreads > 0 ? nthreads : 1;
    float *mem = malloc(sizeof(float) * (per * (size_t)nt + parts) + sizeof(int64_t) * (size_t)(3 * nc + R + 1));
    if (!mem) return -2;
    float *partials = mem + per * (size_t)nt;
    int64_t *plan = (int64_t *)(partials + parts);
    lowbit_paged_attention_plan(R, ctx, window, plan);
#pragma omp parallel num_threads(nt)
    lowbit_paged_attention_team(q, sq, R, H, Hkv, D, plan, nc, tables, toff, page_size, ks, vs, rot, sinks, scale, mem,
                                per, partials, out);
    free(mem);
    return 0;
}

/* fp32 → fp16 bits, round to nearest even (torch's .half()). */
static inline uint16_t to_half(float v) { return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }

/* Whether a side takes quantize-on-write of D-wide vectors: fp32 or fp16 values, or 8/4-bit codes in
 * groups that divide D (4 bits: even groups). */
static int kv_side_ok(const lowbit_kv_side *s, int64_t D) {
    if (D % 2) return 0;
    if (s->bits == 32 || s->bits == 16) return 1;
    return (s->bits == 8 || s->bits == 4) && !(D % s->group || s->group % 2);
}

/* Quantize-on-write of one (token m, head h) vector (kernels/kv_quant.py's specs, the same arithmetic:
 * fp32 group max/min, the scale rounded to fp16 before the codes are chosen, round half to even):
 * x fp32 [M, Hkv, D] (token rows sx floats apart, heads D apart), rotated first (x @ R, rot its D
 * signs: `rotate`) when given, into its slot of the side; f16 sides store fp16(x), f32 sides x itself
 * (neither is rotated). y: D floats of scratch. */
static void kv_write_one(const float *x, int64_t sx, int64_t Hkv, int64_t D, const int64_t *slots, int64_t page_size,
                         const lowbit_kv_side *s, const float *rot, int64_t m, int64_t h, float *y) {
    const int64_t t = ((slots[m] / page_size) * Hkv + h) * page_size + slots[m] % page_size;
    const float *xv = x + m * sx + h * D;
    if (rot && s->bits < 16) {
        rotate(xv, rot, D, 0, y);
        xv = y;
    }
    if (s->bits == 32) {
        for (int64_t d = 0; d < D; d++) ((float *)s->codes)[t * D + d] = xv[d];
        return;
    }
    if (s->bits == 16) {
        for (int64_t d = 0; d < D; d++) ((uint16_t *)s->codes)[t * D + d] = to_half(xv[d]);
        return;
    }
    const int64_t G = D / s->group, g = s->group;
    for (int64_t gi = 0; gi < G; gi++) {
        const float *v = xv + gi * g;
        if (s->bits == 8) {
            float amax = 0.0f;
            for (int64_t k = 0; k < g; k++) amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
            const uint16_t d16 = to_half(amax / 127.0f);
            const float d = _cvtsh_ss(d16), inv = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *c = (int8_t *)s->codes + t * D + gi * g;
            for (int64_t k = 0; k < g; k++) {
                const float q = nearbyintf(v[k] * inv);
                c[k] = (int8_t)(q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q);
            }
            s->scales[t * G + gi] = d16;
        } else {
            float lo = v[0], hi = v[0];
            for (int64_t k = 1; k < g; k++) {
                lo = v[k] < lo ? v[k] : lo;
                hi = v[k] > hi ? v[k] : hi;
            }
            const uint16_t m16 = to_half(lo);
            const float mn = _cvtsh_ss(m16);
            const uint16_t d16 = to_half((hi - mn) / 15.0f);
            const float d = _cvtsh_ss(d16), inv = d > 0.0f ? 1.0f / d : 0.0f;
            uint8_t *c = (uint8_t *)s->codes + (t * D + gi * g) / 2;
            for (int64_t k = 0; k < g; k += 2) {
                float u0 = nearbyintf((v[k] - mn) * inv), u1 = nearbyintf((v[k + 1] - mn) * inv);
                u0 = u0 < 0.0f ? 0.0f : u0 > 15.0f ? 15.0f : u0;
                u1 = u1 < 0.0f ? 0.0f : u1 > 15.0f ? 15.0f : u1;
                c[k / 2] = (uint8_t)((uint8_t)u0 | ((uint8_t)u1 << 4));
            }
            s->scales[t * G + gi] = d16;
            s->mins[t * G + gi] = m16;
        }
    }
}

/* Every (token, head) vector of x fp32 [M, Hkv, D] into its slot of side s (kv_write_one). */
int lowbit_kv_write(const float *x, int64_t sx, int64_t M, int64_t Hkv, int64_t D, const int64_t *slots,
                    int64_t page_size, const lowbit_kv_side *s, const float *rot) {
    if (!kv_side_ok(s, D)) return -1;
    float y[D];
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < Hkv; h++) kv_write_one(x, sx, Hkv, D, slots, page_size, s, rot, m, h, y);
    return 0;
}

/* A step's K and V (kx, vx: [M, Hkv, D], rows sx apart) into sides ks and vs, the (side, token, head)
 * vectors shared out over the threads of the region (each is written alone, so the pool is what the
 * serial form writes). A team function; the sides are checked by the caller (kv_side_ok). */
int lowbit_kv_write_team(const float *kx, const float *vx, int64_t sx, int64_t M, int64_t Hkv, int64_t D,
                         const int64_t *slots, int64_t page_size, const lowbit_kv_side *ks, const lowbit_kv_side *vs,
                         const float *rot) {
    if (!kv_side_ok(ks, D) || !kv_side_ok(vs, D)) return -1;
    float y[D];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < 2 * M * Hkv; i++) {
        const int v = i >= M * Hkv;
        const int64_t j = i - v * M * Hkv;
        kv_write_one(v ? vx : kx, sx, Hkv, D, slots, page_size, v ? vs : ks, rot, j / Hkv, j % Hkv, y);
    }
    return 0;
}
