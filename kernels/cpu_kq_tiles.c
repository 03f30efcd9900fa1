/* The integer inner loops for GGML's K-quant, 5-bit and MXFP4 blocks repacked into lowbit's tiles (kind 4
 * of cpu_kernels.h: Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, MXFP4; kernels/kq_mm.py writes the layout and is the spec).
 * Compiled once per instruction set, as cpu_wq_tiles.c, whose int4 passes these follow: a block's codes
 * are int4's 4 x 64 bytes of low nibbles in VNNI quad order plus, for 5- and 6-bit codes, their high
 * bits in 64 or 128 bytes laid out as the nibbles (byte [r][i] of the plane serves byte [j][r][i] of every
 * chunk j), so one shift and one AND-OR per 64-byte vector put the fifth and sixth bits back. The codes
 * u (unsigned: 0..15, 0..31, 0..63) multiply the activation planes h, l exactly as int4's do.
 *
 * The scales stay two-level, as the file has them: per group (a super-block of 256, or a block of 32
 * for Q5_0 / Q5_1) the 16 rows' fp16 super-scales, and per sub-block their small integer scales
 * (Q4_K / Q5_K: 6-bit scale and min per 32, packed 12 bytes a row as GGUF packs them, stored byte i of
 * the 16 rows together; Q6_K: an int8 scale per 16). Per block and 16 rows, a = d sc and b = dmin m are
 * exact fp32 (11 + 8 bits), formed once per pass and shared by its rows. Then the epilogue, one order
 * on every instruction set (kq_mm.py kq_mm_fast_ref):
 *
 *   Q4_K, Q5_K (w = a u - b):   y = y + (float)T * (a * s);  y = y - b * sS
 *   Q5_0 (w = d (u - 16)):      y = y + (float)(T - 16 S) * (d * s)
 *   Q5_1 (w = d u + m):         y = y + (float)T * (d * s);  y = y + m * sS
 *   Q6_K (w = a (u - 32), per 16): y = y + (float)(T0 - 32 S0) * (a0 * s);  y = y + (float)(T1 - 32 S1) * (a1 * s)
 *   MXFP4 (w = a (u - 16)):     y = y + (float)(T - 16 S) * (a * s),  a = 2^(e - 128) per block of 32
 *
 * MXFP4's nibbles index a codebook of signed codes c (-12..12); one byte shuffle per vector turns them into
 * u = c + 16 (4..28), an unsigned operand whose T - 16 S is sum c q: |sum c q| <= 12 x 32512 x 32 < 2^24,
 * so (float)(T - 16 S) is exact, and a * s is too (a power of two) unless it leaves fp32's normal range.
 *
 * with T = sum u q over the block (T0, T1 over its halves), S the codes' sum, s and sS = s (float)S the
 * activation block's (lowbit_qblock). T is an exact integer on every path; (float)T rounds only for 5-bit
 * codes with mins (|T| <= 31 x 32512 x 32 < 2^25), the same rounding everywhere. AVX2 sums vpmaddubsw's
 * int16 pairs: <= 2 x 15 x 128 each for 4-bit codes (8 fit in int16), 2 x 31 x 128 for 5-bit (4 fit),
 * 2 x 63 x 128 for 6-bit (2 fit), so 5- and 6-bit codes are widened to int32 after every 2 or 1 chunks
 * (MXFP4's u <= 28: 2 x 28 x 128 each, 4 fit, every 2 chunks). */
#include "cpu_tiles.h"

#define IS_Q5(ST) ((ST) == LOWBIT_Q5_K || (ST) == LOWBIT_Q5_0 || (ST) == LOWBIT_Q5_1)
#define HAS_DMIN(ST) ((ST) == LOWBIT_Q4_K || (ST) == LOWBIT_Q5_K)
#define HAS_M(ST) ((ST) == LOWBIT_Q5_1)  /* a per-block min m: y + m sS */
#define HAS_PLANES(ST) (IS_Q5(ST) || (ST) == LOWBIT_Q6_K)  /* high-bit planes after a block's nibbles */
#define OFF16(ST) ((ST) == LOWBIT_Q5_0 || (ST) == LOWBIT_MXFP4)  /* u = c + 16: T - 16 S */

/* MXFP4's codebook (kernels/ggml_blocks.py KVALUES_MXFP4) + 16: the unsigned codes u its nibbles index. */
static const uint8_t mxfp4_u[16] = {16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4};

/* Q4_K / Q5_K: block j's 6-bit scales and mins of the 16 rows (bytes), from the header's 12 packed bytes
 * a row (byte i of the 16 rows at 64 + 16 i), GGUF's get_scale_min_k4 on 16 rows at once. */
static inline void scale_min_k4(const uint8_t *hdr, int64_t j, __m128i *sc, __m128i *mn) {
#define QB(i) _mm_loadu_si128((const __m128i *)(hdr + 64 + 16 * (i)))
    const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m30 = _mm_set1_epi8(0x30);
    if (j < 4) {
        *sc = _mm_and_si128(QB(j), m63);
        *mn = _mm_and_si128(QB(j + 4), m63);
    } else {
        const __m128i q = QB(j + 4);
        *sc = _mm_or_si128(_mm_and_si128(q, m15), _mm_and_si128(_mm_srli_epi16(QB(j - 4), 2), m30));
        *mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), m15), _mm_and_si128(_mm_srli_epi16(QB(j), 2), m30));
    }
#undef QB
}

/* Bits of each byte of v moved so that bit `from` lands on bit 4 (16-bit lane shifts: only bits that
 * stay inside their byte are kept by the caller's mask). */
#if LB_ISA == 3
typedef __m512i VI;
typedef __m512 VF;
#define VLOAD(p) _mm512_loadu_si512((const void *)(p))
#define VSLLI(v, n) _mm512_slli_epi16(v, n)
#define VSRLI(v, n) _mm512_srli_epi16(v, n)
#define VAND(a, b) _mm512_and_si512(a, b)
#define VSET8(x) _mm512_set1_epi8((char)(x))
#define VANDOR(t, m, u) _mm512_ternarylogic_epi32(t, m, u, 0xEA) /* (t & m) | u */
#define VLUT(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))  /* 16 bytes in each lane */
#define VSHUF(t, i) _mm512_shuffle_epi8(t, i)
#else
typedef __m256i VI;
typedef __m256 VF;
#define VLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VSLLI(v, n) _mm256_slli_epi16(v, n)
#define VSRLI(v, n) _mm256_srli_epi16(v, n)
#define VAND(a, b) _mm256_and_si256(a, b)
#define VSET8(x) _mm256_set1_epi8((char)(x))
#define VANDOR(t, m, u) _mm256_or_si256(_mm256_and_si256(t, m), u)
#define VLUT(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define VSHUF(t, i) _mm256_shuffle_epi8(t, i)
#endif

static inline VI to_bit4(VI v, const int from) {
    return from < 4 ? VSLLI(v, 4 - from) : from > 4 ? VSRLI(v, from - 4) : v;
}

/* The codes of nibble h (0 low, 1 high) of chunk j (64 bytes loaded as v; its half on 256 bits), with
 * the type's high bits from the planes p0, p1 (the same part of them). */
static inline __attribute__((always_inline)) VI kq_codes(const int ST, VI v, VI p0, VI p1, const int j,
                                                         const int h) {
    VI u = h ? VAND(VSRLI(v, 4), VSET8(15)) : VAND(v, VSET8(15));
    if (ST == LOWBIT_MXFP4) return VSHUF(VLUT(mxfp4_u), u);
    if (IS_Q5(ST)) u = VANDOR(to_bit4(p0, 2 * j + h), VSET8(0x10), u);
    if (ST == LOWBIT_Q6_K) {
        const int vv = 2 * j + h;
        u = VANDOR(to_bit4(vv < 4 ? p0 : p1, 2 * (vv & 3)), VSET8(0x30), u);
    }
    return u;
}

#if LB_ISA == 3
/* ---- 512 bits: 16 rows per vector, fp32 sums in registers (cpu_wq_tiles.c int4_pass) ---- */

/* The block's scale vectors for the 16 rows: s0 = a (Q6_K: a0), s1 = b (Q4_K, Q5_K), m (Q5_1), a1 (Q6_K). */
static inline __attribute__((always_inline)) void kq_scales(const int ST, const uint8_t *hdr, int64_t bb, __m512 d,
                                                            __m512 dm, __m512 *s0, __m512 *s1) {
    if (HAS_DMIN(ST)) {
        __m128i sc, mn;
        scale_min_k4(hdr, bb, &sc, &mn);
        *s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
        *s1 = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
    } else if (ST == LOWBIT_Q6_K) {
        const __m128i *sc = (const __m128i *)(hdr + 32 + 32 * bb);
        *s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sc))));
        *s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sc + 1))));
    } else if (ST == LOWBIT_MXFP4) {  /* lowbit_e8m0_half on the 16 rows' exponent bytes of block bb */
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(hdr + 16 * bb)));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
        *s0 = *s1 = _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)),
                                                                normal, sub));
    } else {
        *s0 = d, *s1 = dm;
    }
}

/* acc += the block's (or half's) term for one row, T = 256 sum(u h) + sum(u l) its integer sum. */
static inline __attribute__((always_inline)) __m512 kq_epilogue(const int ST, __m512 acc, __m512i T, __m512 s0,
                                                                __m512 s1, const lowbit_qblock *q, const int half) {
    if (OFF16(ST)) T = _mm512_sub_epi32(T, _mm512_set1_epi32(q->S16));
    if (ST == LOWBIT_Q6_K) T = _mm512_sub_epi32(T, _mm512_set1_epi32(half ? q->S32b : q->S32a));
    const __m512 a = ST == LOWBIT_Q6_K && half ? s1 : s0;
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(T), _mm512_mul_ps(a, _mm512_set1_ps(q->s))));
    if (HAS_DMIN(ST)) acc = _mm512_sub_ps(acc, _mm512_mul_ps(s1, _mm512_set1_ps(q->sS)));
    if (HAS_M(ST)) acc = _mm512_add_ps(acc, _mm512_mul_ps(s1, _mm512_set1_ps(q->sS)));
    return acc;
}

/* A group's super-scales d and dmin (m for Q5_1; d again where there is none), 16 rows; MXFP4 has none
 * (its scales are per block: kq_scales). */
static inline __attribute__((always_inline)) void kq_group(const int ST, const uint8_t *hdr, __m512 *d, __m512 *dm) {
    *d = ST == LOWBIT_MXFP4 ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hdr));
    *dm = HAS_DMIN(ST) || HAS_M(ST) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 32))) : *d;
}

/* What a pass needs of block bb of a group: its codes, its scale vectors, its codes' high-bit planes. */
typedef struct {
    const uint8_t *cb;
    __m512 s0, s1;
    __m512i p0, p1;
} kq_block512;

static inline __attribute__((always_inline)) kq_block512 kq_block(const int ST, const uint8_t *hdr,
                                                                  const uint8_t *codes, int64_t bb, __m512 d,
                                                                  __m512 dm) {
    kq_block512 k;
    k.cb = codes + bb * lowbit_kq_block(ST);
    kq_scales(ST, hdr, bb, d, dm, &k.s0, &k.s1);
    k.p0 = HAS_PLANES(ST) ? VLOAD(k.cb + 256) : _mm512_setzero_si512();
    k.p1 = ST == LOWBIT_Q6_K ? VLOAD(k.cb + 320) : k.p0;
    return k;
}

static inline __attribute__((always_inline)) void kq_pass(const int ST, const int R, int64_t m0,
                                                          const lowbit_linear *w, const lowbit_qact *a,
                                                          const uint8_t *tile, int64_t n0, float *y) {
    const int64_t G = w->K / w->group, nbg = w->group / 32;
    __m512 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    lowbit_group_walk walk = lowbit_walk(w, tile);
    for (int64_t gi = 0; gi < G; lowbit_walk_next(&walk, gi++)) {
        const uint8_t *hdr = lowbit_walk_scales(&walk, gi), *codes = lowbit_walk_codes(&walk, gi);
        __m512 d, dm;
        kq_group(ST, hdr, &d, &dm);
        for (int64_t bb = 0; bb < nbg; bb++) {
            const int64_t b = gi * nbg + bb;
            const kq_block512 k = kq_block(ST, hdr, codes, bb, d, dm);
            const uint8_t *cb = k.cb;
            const __m512 s0 = k.s0, s1 = k.s1;
            const __m512i p0 = k.p0, p1 = k.p1;
            __m512i th[RMAX], tl[RMAX];
            for (int r = 0; r < R; r++) th[r] = tl[r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                const __m512i v = VLOAD(cb + 64 * j);
                const __m512i lo = kq_codes(ST, v, p0, p1, j, 0), hi = kq_codes(ST, v, p0, p1, j, 1);
                planes_dot(R, th, tl, lo, hi, a, m0, b, j);
                if (ST == LOWBIT_Q6_K && j == 1)  /* the first 16 k: its own scale */
                    for (int r = 0; r < R; r++) {
                        acc[r] = kq_epilogue(ST, acc[r], _mm512_add_epi32(_mm512_slli_epi32(th[r], 8), tl[r]), s0, s1,
                                             &a->blk[(m0 + r) * a->nb + b], 0);
                        th[r] = tl[r] = _mm512_setzero_si512();
                    }
            }
            for (int r = 0; r < R; r++)
                acc[r] = kq_epilogue(ST, acc[r], _mm512_add_epi32(_mm512_slli_epi32(th[r], 8), tl[r]), s0, s1,
                                     &a->blk[(m0 + r) * a->nb + b], 1);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (m0 + r) * w->N + n0, acc[r]);
}

/* Eight rows (a prompt's): one accumulator per row — the block's 8 code vectors decoded once into
 * registers, every row's h-plane products, a shift by 8, then its l-plane products — so the decoding and
 * the scales are shared by twice the rows and each row's epilogue combines no planes. The same
 * integer T and epilogue as kq_pass, so a row's bits do not depend on which pass took it. */
static inline __attribute__((always_inline)) void kq_pass8(const int ST, const int R, int64_t m0,
                                                           const lowbit_linear *w, const lowbit_qact *a,
                                                           const uint8_t *tile, int64_t n0, float *y) {
    const int64_t G = w->K / w->group, nbg = w->group / 32;
    const int halves = ST == LOWBIT_Q6_K ? 2 : 1, per = 8 / halves;  /* code vectors per half */
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    lowbit_group_walk walk = lowbit_walk(w, tile);
    for (int64_t gi = 0; gi < G; lowbit_walk_next(&walk, gi++)) {
        const uint8_t *hdr = lowbit_walk_scales(&walk, gi), *codes = lowbit_walk_codes(&walk, gi);
        __m512 d, dm;
        kq_group(ST, hdr, &d, &dm);
        for (int64_t bb = 0; bb < nbg; bb++) {
            const int64_t b = gi * nbg + bb;
            const kq_block512 k = kq_block(ST, hdr, codes, bb, d, dm);
            const uint8_t *cb = k.cb;
            const __m512 s0 = k.s0, s1 = k.s1;
            const __m512i p0 = k.p0, p1 = k.p1;
            const int8_t *x[8];  /* each row's activation words of this block */
            for (int r = 0; r < R; r++) x[r] = HL(a, m0 + r, b, 0, 8);
#pragma GCC unroll 2
            for (int half = 0; half < halves; half++) {  /* the loops unrolled: u and T stay in registers */
                __m512i u[8], T[8];
#pragma GCC unroll 8
                for (int v = 0; v < per; v++) {  /* v: nibble vector 2j + h of the half */
                    const int vv = half * per + v;
                    u[v] = kq_codes(ST, VLOAD(cb + 64 * (vv >> 1)), p0, p1, vv >> 1, vv & 1);
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) T[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
                for (int pl = 0; pl < 2; pl++) {  /* the h plane, then the l plane */
                    if (pl)
#pragma GCC unroll 8
                        for (int r = 0; r < R; r++) T[r] = _mm512_slli_epi32(T[r], 8);
#pragma GCC unroll 8
                    for (int v = 0; v < per; v++) {
                        const int vv = half * per + v;  /* k 8j..8j+3 (h = 0) or 8j+4.. (h = 1): 16 bytes a j */
#pragma GCC unroll 8
                        for (int r = 0; r < R; r++) {
                            T[r] = dpbusd_b(T[r], u[v], x[r] + 16 * (vv >> 1) + 8 * (vv & 1) + 4 * pl);
                            KEEP(T[r]);
                        }
                    }
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
                    acc[r] = kq_epilogue(ST, acc[r], T[r], s0, s1, &a->blk[(m0 + r) * a->nb + b], half || halves == 1);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (m0 + r) * w->N + n0, acc[r]);
}

#define KQ_TILES(ST, name)                                                                                \
    static inline __attribute__((always_inline)) void name##_pass(const int R, int64_t m0,                 \
                                                                  const lowbit_linear *w,                  \
                                                                  const lowbit_qact *a,                    \
                                                                  const uint8_t *tile, int64_t n0, float *y) { \
        kq_pass(ST, R, m0, w, a, tile, n0, y);                                                            \
    }                                                                                                     \
    static inline __attribute__((always_inline)) void name##_pass8(const int R, int64_t m0,                \
                                                                   const lowbit_linear *w,                 \
                                                                   const lowbit_qact *a,                   \
                                                                   const uint8_t *tile, int64_t n0, float *y) { \
        kq_pass8(ST, R, m0, w, a, tile, n0, y);                                                           \
    }                                                                                                     \
    static __attribute__((noinline)) void name##_tiles(const lowbit_linear *w, const lowbit_qact *a,      \
                                                       int64_t m0, int64_t mc, int64_t t0, int64_t t1,    \
                                                       float *y) {                                        \
        const int64_t tile_bytes = lowbit_tile_bytes(w);                                                  \
        for (int64_t t = t0; t < t1; t++) {                                                               \
            const uint8_t *tile = w->data + t * tile_bytes;                                               \
            ROW_PASSES8(name##_pass8, name##_pass, m0, mc, w, a, tile, t * LOWBIT_TILE, y)                \
        }                                                                                                 \
    }

#else
/* ---- 256 bits: a tile as two halves of 8 rows, fp32 sums in y (cpu_wq_tiles.c int4_full) ---- */

static inline __attribute__((always_inline)) void kq_scales(const int ST, const uint8_t *hdr, int64_t bb, int half,
                                                            __m256 d, __m256 dm, __m256 *s0, __m256 *s1) {
    if (HAS_DMIN(ST)) {
        __m128i sc, mn;
        scale_min_k4(hdr, bb, &sc, &mn);
        if (half) sc = _mm_srli_si128(sc, 8), mn = _mm_srli_si128(mn, 8);
        *s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
        *s1 = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
    } else if (ST == LOWBIT_Q6_K) {
        const uint8_t *sc = hdr + 32 + 32 * bb + 8 * half;
        *s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
        *s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16)))));
    } else if (ST == LOWBIT_MXFP4) {  /* lowbit_e8m0_half on the half's 8 exponent bytes of block bb */
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(hdr + 16 * bb + 8 * half)));
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        *s0 = *s1 = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
    } else {
        *s0 = d, *s1 = dm;
    }
}

/* y[0..8) += the block's (or half's) term, T its integer sum. */
static inline __attribute__((always_inline)) void kq_epilogue(const int ST, float *yo, __m256i T, __m256 s0,
                                                              __m256 s1, const lowbit_qblock *q, const int half) {
    if (OFF16(ST)) T = _mm256_sub_epi32(T, _mm256_set1_epi32(q->S16));
    if (ST == LOWBIT_Q6_K) T = _mm256_sub_epi32(T, _mm256_set1_epi32(half ? q->S32b : q->S32a));
    const __m256 a = ST == LOWBIT_Q6_K && half ? s1 : s0;
    __m256 acc = _mm256_add_ps(_mm256_loadu_ps(yo), _mm256_mul_ps(_mm256_cvtepi32_ps(T), _mm256_mul_ps(a, _mm256_set1_ps(q->s))));
    if (HAS_DMIN(ST)) acc = _mm256_sub_ps(acc, _mm256_mul_ps(s1, _mm256_set1_ps(q->sS)));
    if (ST == LOWBIT_Q5_1) acc = _mm256_add_ps(acc, _mm256_mul_ps(s1, _mm256_set1_ps(q->sS)));
    _mm256_storeu_ps(yo, acc);
}

#if LB_ISA == 1
/* AVX2: after how many chunks j the int16 pair sums must be widened (the file's comment). */
#define FLUSH_EVERY(ST) ((ST) == LOWBIT_Q6_K ? 1 : IS_Q5(ST) || (ST) == LOWBIT_MXFP4 ? 2 : 4)
#endif

static inline __attribute__((always_inline)) void kq_full(const int ST, const int R, const int H, int64_t m0,
                                                          const lowbit_linear *w, const lowbit_qact *a,
                                                          const uint8_t *tile, int64_t n0, int half0, float *y) {
    const int64_t G = w->K / w->group, nbg = w->group / 32, BB = lowbit_kq_block(ST), N = w->N;
    float *yr = zeroed_rows(y + m0 * N + n0 + 8 * half0, R, H, N);
    lowbit_group_walk walk = lowbit_walk(w, tile);
    for (int64_t gi = 0; gi < G; lowbit_walk_next(&walk, gi++)) {
        const uint8_t *hdr = lowbit_walk_scales(&walk, gi), *codes = lowbit_walk_codes(&walk, gi);
        __m256 d[2], dm[2];
        for (int h = 0; h < H; h++) {
            d[h] = ST == LOWBIT_MXFP4 ? _mm256_setzero_ps()  /* its scales are per block (kq_scales) */
                                      : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * (half0 + h))));
            dm[h] = HAS_DMIN(ST) || ST == LOWBIT_Q5_1
                        ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 32 + 16 * (half0 + h)))) : d[h];
        }
        for (int64_t bb = 0; bb < nbg; bb++) {
            const int64_t b = gi * nbg + bb;
            const uint8_t *cb = codes + bb * BB + 32 * half0;
            __m256 s0[2], s1[2];
            __m256i p0[2], p1[2];
            for (int h = 0; h < H; h++) {
                kq_scales(ST, hdr, bb, half0 + h, d[h], dm[h], &s0[h], &s1[h]);
                p0[h] = HAS_PLANES(ST) ? VLOAD(cb + 256 + 32 * h) : _mm256_setzero_si256();
                p1[h] = ST == LOWBIT_Q6_K ? VLOAD(cb + 320 + 32 * h) : p0[h];
            }
            __m256i th[2][4], tl[2][4];  /* AVX2: int16 pair sums, widened into T at each flush */
#if LB_ISA == 1
            __m256i T[2][4];
#endif
            for (int h = 0; h < H; h++)
                for (int r = 0; r < R; r++) {
                    th[h][r] = tl[h][r] = _mm256_setzero_si256();
#if LB_ISA == 1
                    T[h][r] = _mm256_setzero_si256();
#endif
                }
            for (int j = 0; j < 4; j++) {
                __m256i lo[2], hi[2];
                for (int h = 0; h < H; h++) {
                    const __m256i v = VLOAD(cb + 64 * j + 32 * h);
                    lo[h] = kq_codes(ST, v, p0[h], p1[h], j, 0), hi[h] = kq_codes(ST, v, p0[h], p1[h], j, 1);
                }
                planes_dot(R, H, th, tl, lo, hi, a, m0, b, j);
#if LB_ISA == 1
                if ((j + 1) % FLUSH_EVERY(ST) == 0)
                    for (int h = 0; h < H; h++)
                        for (int r = 0; r < R; r++) {
                            T[h][r] = _mm256_add_epi32(T[h][r], planes_sum(th[h][r], tl[h][r]));
                            th[h][r] = tl[h][r] = _mm256_setzero_si256();
                        }
#endif
                if (ST == LOWBIT_Q6_K && j == 1)  /* the first 16 k: its own scale */
                    for (int r = 0; r < R; r++) {
                        const lowbit_qblock *q = &a->blk[(m0 + r) * a->nb + b];
                        for (int h = 0; h < H; h++) {
#if LB_ISA == 1
                            kq_epilogue(ST, yr + r * N + 8 * h, T[h][r], s0[h], s1[h], q, 0);
                            T[h][r] = _mm256_setzero_si256();
#else
                            kq_epilogue(ST, yr + r * N + 8 * h, planes_sum(th[h][r], tl[h][r]), s0[h], s1[h], q, 0);
                            th[h][r] = tl[h][r] = _mm256_setzero_si256();
#endif
                        }
                    }
            }
            for (int r = 0; r < R; r++) {
                const lowbit_qblock *q = &a->blk[(m0 + r) * a->nb + b];
                for (int h = 0; h < H; h++)
#if LB_ISA == 1
                    kq_epilogue(ST, yr + r * N + 8 * h, T[h][r], s0[h], s1[h], q, 1);
#else
                    kq_epilogue(ST, yr + r * N + 8 * h, planes_sum(th[h][r], tl[h][r]), s0[h], s1[h], q, 1);
#endif
            }
        }
    }
}

#if LB_ISA == 1
#define KQ_HALF_WD kq_half_wd
/* AVX2, 6-bit codes, one half of a tile: the codes widened to int16 and multiplied by the int16 activation
 * codes with vpmaddwd (as AVX2's int8 tiles are): exact int32 pair sums, where vpmaddubsw's int16 sums of
 * 6-bit codes must be widened after every chunk. The same integer T, so the same bits. Against the planes,
 * A/B in one process, 8192x2048 x 8 weights from memory, 2 threads: one row 0.78-0.91x the time, 16 rows 0.95-0.97x;
 * for 5-bit codes it was slower (Q5_K one row 1.16x), so they keep the planes. */
static inline __attribute__((always_inline)) void kq_half_wd(const int ST, const int R, int64_t m0,
                                                             const lowbit_linear *w, const lowbit_qact *a,
                                                             const uint8_t *tile, int64_t n0, int half, float *y) {
    const int64_t G = w->K / w->group, nbg = w->group / 32, BB = lowbit_kq_block(ST), N = w->N;
    float *yr = zeroed_rows(y + m0 * N + n0 + 8 * half, R, 1, N);
    lowbit_group_walk walk = lowbit_walk(w, tile);
    for (int64_t gi = 0; gi < G; lowbit_walk_next(&walk, gi++)) {
        const uint8_t *hdr = lowbit_walk_scales(&walk, gi), *codes = lowbit_walk_codes(&walk, gi);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * half)));
        const __m256 dm = HAS_DMIN(ST) || ST == LOWBIT_Q5_1
                              ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 32 + 16 * half))) : d;
        for (int64_t bb = 0; bb < nbg; bb++) {
            const int64_t b = gi * nbg + bb;
            const uint8_t *cb = codes + bb * BB + 32 * half;
            __m256 s0, s1;
            kq_scales(ST, hdr, bb, half, d, dm, &s0, &s1);
            const __m256i p0 = VLOAD(cb + 256), p1 = ST == LOWBIT_Q6_K ? VLOAD(cb + 320) : p0;
            __m256i ta[4], tb[4];
            for (int r = 0; r < R; r++) ta[r] = tb[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i v = VLOAD(cb + 64 * j);
                const __m256i lo = kq_codes(ST, v, p0, p1, j, 0), hi = kq_codes(ST, v, p0, p1, j, 1);
                const __m256i la = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
                const __m256i lb = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
                const __m256i ha = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
                const __m256i hb = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
                for (int r = 0; r < R; r++) {
                    const int16_t *q = a->q + (m0 + r) * a->K + b * 32 + 8 * j;
                    const __m256i xl = _mm256_set1_epi64x(load64(q)), xh = _mm256_set1_epi64x(load64(q + 4));
                    ta[r] = _mm256_add_epi32(ta[r], _mm256_add_epi32(_mm256_madd_epi16(la, xl), _mm256_madd_epi16(ha, xh)));
                    tb[r] = _mm256_add_epi32(tb[r], _mm256_add_epi32(_mm256_madd_epi16(lb, xl), _mm256_madd_epi16(hb, xh)));
                }
                if (ST == LOWBIT_Q6_K && j == 1)
                    for (int r = 0; r < R; r++) {
                        kq_epilogue(ST, yr + r * N, pairs_sum(ta[r], tb[r]), s0, s1, &a->blk[(m0 + r) * a->nb + b], 0);
                        ta[r] = tb[r] = _mm256_setzero_si256();
                    }
            }
            for (int r = 0; r < R; r++)
                kq_epilogue(ST, yr + r * N, pairs_sum(ta[r], tb[r]), s0, s1, &a->blk[(m0 + r) * a->nb + b], 1);
        }
    }
}
#else
#define KQ_HALF_WD(...) (void)0
#endif

/* As cpu_wq_tiles.c's entries: one or two rows over whole tiles (the 4-bit types: no high-bit planes
 * to hold), more rows over each half in turn. */
#define WHOLE_TILE(ST) ((ST) == LOWBIT_Q4_K || (ST) == LOWBIT_MXFP4)
#define KQ_TILES(ST, name)                                                                                \
    static inline __attribute__((always_inline)) void name##_half(const int R, int64_t m0,                 \
                                                                  const lowbit_linear *w,                  \
                                                                  const lowbit_qact *a,                    \
                                                                  const uint8_t *tile, int64_t n0, int half, \
                                                                  float *y) {                              \
        if (LB_ISA == 1 && ST == LOWBIT_Q6_K) KQ_HALF_WD(ST, R, m0, w, a, tile, n0, half, y);             \
        else kq_full(ST, R, 1, m0, w, a, tile, n0, half, y);                                              \
    }                                                                                                     \
    static __attribute__((noinline)) void name##_tiles(const lowbit_linear *w, const lowbit_qact *a,      \
                                                       int64_t m0, int64_t mc, int64_t t0, int64_t t1,    \
                                                       float *y) {                                        \
        const int64_t tile_bytes = lowbit_tile_bytes(w);                                                  \
        for (int64_t t = t0; t < t1; t++) {                                                               \
            const uint8_t *tile = w->data + t * tile_bytes;                                               \
            if (mc == 1 && WHOLE_TILE(ST)) kq_full(ST, 1, 2, m0, w, a, tile, t * LOWBIT_TILE, 0, y);      \
            else if (mc == 2 && WHOLE_TILE(ST)) kq_full(ST, 2, 2, m0, w, a, tile, t * LOWBIT_TILE, 0, y); \
            else                                                                                          \
                for (int half = 0; half < 2; half++)                                                      \
                    ROW_PASSES(name##_half, m0, mc, w, a, tile, t * LOWBIT_TILE, half, y)                 \
        }                                                                                                 \
    }
#endif

KQ_TILES(LOWBIT_Q4_K, q4k)
KQ_TILES(LOWBIT_Q5_K, q5k)
KQ_TILES(LOWBIT_Q6_K, q6k)
KQ_TILES(LOWBIT_Q5_0, q50)
KQ_TILES(LOWBIT_Q5_1, q51)
KQ_TILES(LOWBIT_MXFP4, mxfp4)

void NAME(lowbit_kq_tiles)(const lowbit_linear *w, const lowbit_qact *a, int64_t m0, int64_t mc, int64_t t0,
                           int64_t t1, float *y) {
    switch (w->P) {
        case LOWBIT_Q4_K: q4k_tiles(w, a, m0, mc, t0, t1, y); return;
        case LOWBIT_Q5_K: q5k_tiles(w, a, m0, mc, t0, t1, y); return;
        case LOWBIT_Q6_K: q6k_tiles(w, a, m0, mc, t0, t1, y); return;
        case LOWBIT_Q5_0: q50_tiles(w, a, m0, mc, t0, t1, y); return;
        case LOWBIT_Q5_1: q51_tiles(w, a, m0, mc, t0, t1, y); return;
        case LOWBIT_MXFP4: mxfp4_tiles(w, a, m0, mc, t0, t1, y); return;
        default: return;
    }
}
