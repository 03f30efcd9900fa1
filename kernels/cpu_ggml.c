/* GGML's block formats multiplied as GGUF stores them (kind 3 of cpu_kernels.h's lowbit_linear): Q5_0,
 * Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4 (where K is not whole 64-value groups of its
 * tiles, cpu_kq.c), and Q4_0, Q4_1, Q8_0 where they share a fused
 * weight with one of those. kernels/ggml_blocks.py is the spec of each block's values;
 * kernels/ggml_mm.py holds and calls these.
 *
 * Every type decodes a block to integer codes c and, per sub-block of 16, w = a c + b with a and b
 * the products of an fp16 super-scale and a small integer (exact in fp32), so one dot product serves
 * them all:
 *
 *   fast path: y[m][n] = sum over sub-blocks j of  s_j (a_j T_j + b_j S_j),  T_j = sum c q, S_j = sum q,
 *   with q the 16-bit activation codes and s the activation block's scale (lowbit_quantize_rows,
 *   kernels/act_quant.py). T_j is exact (vpmaddwd pairs: |c q| < 2^15 2^7); the fp32 epilogue runs in
 *   a fixed order per (m, n), so a row's result does not depend on M. One build (AVX2) for every
 *   machine, so every instruction set gives the same bits; a copy decoding two 32-value blocks per
 *   512-bit op (the same sums) measured no faster on Zen 4, whose 512-bit ops are two 256-bit halves.
 *
 *   exact path: lowbit_ggml_dequant writes fp32 rows a c + b (a c where b is 0) — the one rounding
 *   gguf.quants.dequantize does too — for kernels/exact_mm.py's GEMM.
 *
 * Work is split by output rows over the threads of the parallel region; a thread decodes one block of
 * one row at a time (into 256 bytes of codes on its stack) and multiplies it by every activation row
 * (a decode step's single row of 32-value blocks keeps the codes in registers: 77 against 150 us for
 * a 1536x576 Q5_0 matrix, one thread). This costs ~28 instructions per 32 weights, ~3x the 16-row
 * tiles of the int4/int8 kernels (cpu_wq_tiles.c): the speed of these types is bounded by that.
 * A weight may hold two row segments of different types (the first `split` rows in type P at data,
 * the rest in type P2 at data2): llama.cpp's mixes give V rows another type than Q and K (Q4_K_M:
 * Q6_K in some layers), and Q, K, V are still one call. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#include <immintrin.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39 };

static const int8_t kvalues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's codebook, E2M1's values doubled; its scale 2^(e - 128) is lowbit_e8m0_half (cpu_kernels.h). */
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Values per block (0: not a type of this file) and bytes per block. */
static int64_t block_values(int64_t t) {
    switch (t) {
        case Q4_0: case Q4_1: case Q8_0: case Q5_0: case Q5_1: case IQ4_NL: case MXFP4: return 32;
        case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: return 256;
        default: return 0;
    }
}

static int64_t block_bytes(int64_t t) {
    switch (t) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q8_0: return 34;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case IQ4_NL: return 18;
        case Q2_K: return 84;
        case Q3_K: return 110;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        case IQ4_XS: return 136;
        case MXFP4: return 17;
        default: return 0;
    }
}

/* Whether b is nonzero for this type (a min term) — then the dot needs S_j. */
static int has_min(int64_t t) { return t == Q4_1 || t == Q5_1 || t == Q2_K || t == Q4_K || t == Q5_K; }

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* 16 bytes → 32: their low nibbles (values 0-15 of a block), then their high nibbles (16-31). */
static inline __m256i nibbles(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

/* Bit i of h → byte i: 0x10 where set, else 0 (the fifth bit of Q5_0 / Q5_1 codes). */
static inline __m256i fifth_bits(uint32_t h) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

/* (v >> s) & mask per byte, s a run-time count. */
static inline __m256i bits_at(__m256i v, int s, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8((char)mask));
}

static inline void store32(int8_t *c, __m256i v) { _mm256_store_si256((__m256i *)c, v); }

/* A 32-value block of type T (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, MXFP4) → its 32 int8 codes in a
 * register, *a its scale and *b its min (Q4_1, Q5_1). The same codes as decode. */
static inline __attribute__((always_inline)) __m256i decode32(const int64_t T, const uint8_t *p, float *a, float *b) {
    if (T == MXFP4) {  /* e, then 16 bytes of codebook indices */
        *a = lowbit_e8m0_half(p[0]);
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_mxfp4)),
                                   nibbles(p + 1));
    }
    *a = f16(p);
    if (T == Q4_1 || T == Q5_1) *b = f16(p + 2);
    if (T == Q8_0) return _mm256_loadu_si256((const __m256i *)(p + 2));
    if (T == Q5_0 || T == Q5_1) {
        uint32_t qh;
        memcpy(&qh, p + (T == Q5_0 ? 2 : 4), 4);
        const __m256i u = _mm256_or_si256(nibbles(p + (T == Q5_0 ? 6 : 8)), fifth_bits(qh));
        return T == Q5_0 ? _mm256_sub_epi8(u, _mm256_set1_epi8(16)) : u;
    }
    const __m256i u = nibbles(p + (T == Q4_1 ? 4 : 2));
    if (T == IQ4_NL) return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues)), u);
    return T == Q4_0 ? _mm256_sub_epi8(u, _mm256_set1_epi8(8)) : u;
}

/* One block → int8 codes c [values] (32-byte aligned), a [values / 16], b [values / 16] (b untouched
 * where has_min is 0). Codes by AVX2 byte shuffles, 32 at a time; scales scalar (one per 16 or 32). */
static inline __attribute__((always_inline)) void decode(int64_t t, const uint8_t *p, int8_t *c, float *a, float *b) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues));
    switch (t) {
        case Q4_0: case Q4_1: case Q8_0: case Q5_0: case Q5_1: case IQ4_NL: case MXFP4:  /* a scale (and min) per 32 */
            store32(c, decode32(t, p, a, b));
            a[1] = a[0];
            if (has_min(t)) b[1] = b[0];
            return;
        case Q2_K: {
            const float d = f16(p + 80), dmin = f16(p + 82);
            for (int j = 0; j < 16; j++) a[j] = d * (float)(p[j] & 0xF), b[j] = -(dmin * (float)(p[j] >> 4));
            for (int h = 0; h < 2; h++) {  /* 128 values per 32 bytes, 4 planes of 2 bits */
                const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * h));
                for (int s = 0; s < 4; s++) store32(c + 128 * h + 32 * s, bits_at(q, 2 * s, 3));
            }
            return;
        }
        case Q3_K: {
            const uint8_t *sb = p + 96;
            const float d = f16(p + 108);
            for (int j = 0; j < 16; j++) {
                const int lo = (sb[j & 7] >> (4 * (j >> 3))) & 0xF, hi = (sb[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
                a[j] = d * (float)((lo | hi << 4) - 32);
            }
            const __m256i hm = _mm256_loadu_si256((const __m256i *)p), four = _mm256_set1_epi8(4);
            for (int h = 0; h < 2; h++) {  /* q = low 2 bits - 4, + 4 where the mask bit is set */
                const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h));
                for (int s = 0; s < 4; s++) {
                    const __m256i hb = _mm256_slli_epi16(bits_at(hm, 4 * h + s, 1), 2);
                    store32(c + 128 * h + 32 * s, _mm256_sub_epi8(_mm256_or_si256(bits_at(q, 2 * s, 3), hb), four));
                }
            }
            return;
        }
        case Q4_K: case Q5_K: {
            const float d = f16(p), dmin = f16(p + 2);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                scale_min_k4(j, p + 4, &sc, &m);
                a[2 * j] = a[2 * j + 1] = d * (float)sc;
                b[2 * j] = b[2 * j + 1] = -(dmin * (float)m);
            }
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
            const uint8_t *qs = p + (t == Q5_K ? 48 : 16);
            for (int g = 0; g < 4; g++) {  /* 64 values per 32 bytes: low nibbles, then high */
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
                __m256i lo = bits_at(q, 0, 0xF), hi = bits_at(q, 4, 0xF);
                if (t == Q5_K) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(bits_at(qh, 2 * g, 1), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(bits_at(qh, 2 * g + 1, 1), 4));
                }
                store32(c + 64 * g, lo), store32(c + 64 * g + 32, hi);
            }
            return;
        }
        case Q6_K: {
            const int8_t *sc = (const int8_t *)(p + 192);
            const float d = f16(p + 208);
            for (int j = 0; j < 16; j++) a[j] = d * (float)sc[j];
            for (int h = 0; h < 2; h++) {  /* 128 values: ql 64 bytes (2 nibble runs), qh 32 bytes */
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
                for (int s = 0; s < 4; s++) {
                    const __m256i lo = bits_at(s & 1 ? l1 : l0, 4 * (s >> 1), 0xF);
                    const __m256i hi = _mm256_slli_epi16(bits_at(qh, 2 * s, 3), 4);
                    store32(c + 128 * h + 32 * s, _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32)));
                }
            }
            return;
        }
        case IQ4_XS: {
            const float d = f16(p);
            uint16_t sh;
            memcpy(&sh, p + 2, 2);
            for (int j = 0; j < 8; j++) {
                const int ls = ((p[4 + (j >> 1)] >> (4 * (j & 1))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
                a[2 * j] = a[2 * j + 1] = d * (float)(ls - 32);
                store32(c + 32 * j, _mm256_shuffle_epi8(lut, nibbles(p + 8 + 16 * j)));
            }
            return;
        }
        default: return;
    }
}

/* The segment holding row n: its type, and the row's bytes. */
static inline const uint8_t *row_of(const lowbit_linear *w, int64_t n, int64_t *t) {
    if (n < w->split) {
        *t = w->P;
        return w->data + n * (w->K / block_values(w->P)) * block_bytes(w->P);
    }
    *t = w->P2;
    return w->data2 + (n - w->split) * (w->K / block_values(w->P2)) * block_bytes(w->P2);
}

/* 0 if w is a kind-3 weight these kernels take, else -1. */
int lowbit_ggml_check(const lowbit_linear *w) {
    if (w->kind != 3 || !w->data || w->N < 1 || w->K < 1 || w->split < 0 || w->split > w->N) return -1;
    for (int s = 0; s < 2; s++) {
        const int64_t t = s ? w->P2 : w->P, rows = s ? w->N - w->split : w->split;
        if (rows == 0) continue;
        if (!block_values(t) || w->K % block_values(t) || (s && !w->data2)) return -1;
    }
    return 0;
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Codes 32..47 or 48..63 etc.: 16 int8 codes → 16 int16. */
static inline __m256i widen(const int8_t *c) { return _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)c)); }

/* One decoded block times activation row m: v += per 16 (or 32) values s a T (and s b S for Q2_K's
 * per-16 mins), *vb += b sS for mins per 32. `sub16`: a and b change every 16 values. */
static inline __attribute__((always_inline)) void block_dot(const int sub16, const int mins, const int per16,
                                                            int64_t qk, const int8_t *c, const float *sa, const float *sb,
                                                            const int16_t *xq, const lowbit_qblock *blk, __m256 *v,
                                                            float *vb) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t j = 0; j < qk / 32; j++) {
        const lowbit_qblock q = blk[j];
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 32 * j));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 32 * j + 16));
        const __m256i t0 = _mm256_madd_epi16(widen(c + 32 * j), x0), t1 = _mm256_madd_epi16(widen(c + 32 * j + 16), x1);
        if (sub16) {
            *v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t0), _mm256_set1_ps(q.s * sa[2 * j]), *v);
            *v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t1), _mm256_set1_ps(q.s * sa[2 * j + 1]), *v);
        } else {
            *v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(t0, t1)), _mm256_set1_ps(q.s * sa[2 * j]), *v);
        }
        if (per16) {
            *v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(x0, ones)), _mm256_set1_ps(q.s * sb[2 * j]), *v);
            *v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(x1, ones)), _mm256_set1_ps(q.s * sb[2 * j + 1]), *v);
        } else if (mins) {
            *vb += sb[2 * j] * q.sS;
        }
    }
}

/* One 32-value block of type T times activation block q (codes x): v += s a T, *vb += b sS — block_dot's
 * arithmetic for one block, its codes kept in a register. */
static inline __attribute__((always_inline)) void block32_dot(const int64_t T, const uint8_t *p, const int16_t *x,
                                                              lowbit_qblock q, __m256 *v, float *vb) {
    float sa, sb = 0.0f;
    const __m256i u = decode32(T, p, &sa, &sb);
    const __m256i t = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(u)), _mm256_loadu_si256((const __m256i *)x)),
        _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(u, 1)), _mm256_loadu_si256((const __m256i *)(x + 16))));
    *v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(q.s * sa), *v);
    if (T == Q4_1 || T == Q5_1) *vb += sb * q.sS;
}

/* Rows [n0, n1) of y [M, N] (all M activation rows) for rows of type T (a constant where inlined, so
 * each type's decode and dot are compiled on their own); acc [8 M] and accb [M] are scratch. */
static inline __attribute__((always_inline)) void rows_of_type(const int64_t T, const lowbit_linear *w,
                                                               const lowbit_qact *a, const uint8_t *row,
                                                               int64_t n0, int64_t n1, float *y, float *acc,
                                                               float *accb) {
    int8_t c[256] __attribute__((aligned(32)));
    float sa[16], sb[16];
    const int64_t M = a->M, K = w->K, qk = block_values(T), nbytes = block_bytes(T);
    const int sub16 = T == Q2_K || T == Q3_K || T == Q6_K, mins = has_min(T), per16 = T == Q2_K;
    if (M == 1 && qk == 32) {  /* a decode step over 32-value blocks: codes in registers, the same arithmetic */
        const int64_t nb = K / 32;
        for (int64_t n = n0; n < n1; n++, row += nb * nbytes) {
            __m256 v = _mm256_setzero_ps();
            float vb = 0.0f;
            for (int64_t j = 0; j < nb; j++) block32_dot(T, row + j * nbytes, a->q + 32 * j, a->blk[j], &v, &vb);
            y[n] = hsum8(v) + vb;
        }
        return;
    }
    if (M == 1) {  /* one activation row (a decode step): the sums stay in registers, the same arithmetic */
        for (int64_t n = n0; n < n1; n++) {
            __m256 v = _mm256_setzero_ps();
            float vb = 0.0f;
            for (int64_t k0 = 0; k0 < K; k0 += qk, row += nbytes) {
                decode(T, row, c, sa, sb);
                block_dot(sub16, mins, per16, qk, c, sa, sb, a->q + k0, a->blk + k0 / LOWBIT_BLOCK, &v, &vb);
            }
            y[n] = hsum8(v) + vb;
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) {
            _mm256_storeu_ps(acc + 8 * m, _mm256_setzero_ps());
            accb[m] = 0.0f;
        }
        for (int64_t k0 = 0; k0 < K; k0 += qk, row += nbytes) {
            decode(T, row, c, sa, sb);
            for (int64_t m = 0; m < M; m++) {
                __m256 v = _mm256_loadu_ps(acc + 8 * m);
                block_dot(sub16, mins, per16, qk, c, sa, sb, a->q + m * K + k0, a->blk + m * a->nb + k0 / LOWBIT_BLOCK,
                          &v, accb + m);
                _mm256_storeu_ps(acc + 8 * m, v);
            }
        }
        for (int64_t m = 0; m < M; m++) y[m * w->N + n] = hsum8(_mm256_loadu_ps(acc + 8 * m)) + accb[m];
    }
}

/* Rows [n0, n1) of y, each segment's by its type. */
static void ggml_rows(const lowbit_linear *w, const lowbit_qact *a, int64_t n0, int64_t n1, float *y, float *acc,
                      float *accb) {
    for (int s = 0; s < 2; s++) {
        const int64_t lo = s ? (n0 > w->split ? n0 : w->split) : n0, hi = s ? n1 : (n1 < w->split ? n1 : w->split);
        if (hi <= lo) continue;
        int64_t t;
        const uint8_t *row = row_of(w, lo, &t);
        switch (t) {
#define TYPE(T) case T: rows_of_type(T, w, a, row, lo, hi, y, acc, accb); break;
            TYPE(Q4_0) TYPE(Q4_1) TYPE(Q8_0) TYPE(Q5_0) TYPE(Q5_1) TYPE(IQ4_NL) TYPE(MXFP4)
            TYPE(Q2_K) TYPE(Q3_K) TYPE(Q4_K) TYPE(Q5_K) TYPE(Q6_K) TYPE(IQ4_XS)
#undef TYPE
            default: break;
        }
    }
}

/* y [M, N] = a @ W^T (+ bias) for a kind-3 weight: a team function (cpu_wq_mm.c lowbit_linear_team
 * calls it), thread i of n taking rows [N i / n, N (i + 1) / n). */
void lowbit_ggml_team(const lowbit_linear *w, const lowbit_qact *a, float *y) {
    const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
    const int64_t r0 = w->N * i / n, r1 = w->N * (i + 1) / n;
    if (r1 > r0) {
        float acc[9 * a->M];  /* per activation row 8 vector lanes, then one scalar: 36 bytes */
        ggml_rows(w, a, r0, r1, y, acc, acc + 8 * a->M);
        if (w->bias)
            for (int64_t m = 0; m < a->M; m++)
                for (int64_t r = r0; r < r1; r++) y[m * w->N + r] += w->bias[r];
    }
#pragma omp barrier
}

/* Rows [n0, n1) → fp32 out [n1 - n0, K], exactly as kernels/ggml_blocks.py. */
int lowbit_ggml_dequant(const lowbit_linear *w, int64_t n0, int64_t n1, float *out, int nthreads) {
    if (lowbit_ggml_check(w) || n0 < 0 || n1 > w->N || n0 > n1) return -1;
    const int64_t K = w->K;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        int8_t c[256] __attribute__((aligned(32)));
        float sa[16], sb[16];
        int64_t t;
        const uint8_t *row = row_of(w, n, &t);
        const int64_t qk = block_values(t), nbytes = block_bytes(t);
        const int mins = has_min(t);
        float *o = out + (n - n0) * K;
        for (int64_t k0 = 0; k0 < K; k0 += qk, row += nbytes) {
            decode(t, row, c, sa, sb);
            for (int64_t k = 0; k < qk; k++)
                o[k0 + k] = mins ? sa[k >> 4] * (float)c[k] + sb[k >> 4] : sa[k >> 4] * (float)c[k];
        }
    }
    return 0;
}
