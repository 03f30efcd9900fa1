/* The integer inner loops of the CPU matmul y = x @ W^T: output tiles of lowbit's packed layouts
 * (cpu_kernels.h) times activations quantized per block of 32 (kernels/act_quant.py). This file is
 * compiled once per instruction set the CPU has (kernels/cpu_native.py), each copy named by its set:
 *
 *   LB_ISA 1  *_avx2     AVX2: vpmaddubsw (u8 codes x s8 planes) into int16, vpmaddwd to int32;
 *                        int8 weights: vpmaddwd of the zero-extended codes by the int16 activations
 *   LB_ISA 2  *_vnni256  vpdpbusd on 256 bits (AVX-VNNI, or AVX-512 VL where that is what the CPU has)
 *   LB_ISA 3  *_avx512   AVX-512 VNNI: vpdpbusd on 512 bits, a whole 16-row tile per instruction
 *
 * Per 32-k block every path forms the same exact integer, T = sum_k u_k q_k (int4, u in 0..15) or
 * sum_k (q_w,k + 128) q_k (int8, the codes stored offset to unsigned), from the planes q = 256 h + l:
 * T = 256 sum(u h) + sum(u l). Then one epilogue, the same fp32 operations in the same order on every
 * path (kernels/int4_mm.py int4_mm_fast_ref, int8_mm.py int8_mm_fast_ref are its spec):
 *
 *   int4, w = d u + m:   y = y + (float)T * (d * s);  y = y + m * sS        (sS = s * (float)S)
 *   int4, w = d (u - 8): y = y + (float)(T - 8 S) * (d * s)
 *   int8, w = d q:       y = y + (float)(T - 128 S) * (d * s)
 *
 * blocks in k order, s and S = sum_k q_k the row's block scale and code sum. A row's result therefore
 * depends on its own activations only — not on how many rows a call has, nor on the instruction set
 * (tests/test_cpu_native.py checks both bit for bit). Overflow: int4 |T| <= 15 * 32512 * 32 < 2^24
 * (exact in fp32); AVX2's int16 sums hold 8 vpmaddubsw pairs of <= 2 * 15 * 128 = 3840 (<= 30720);
 * int8 T <= 255 * 32512 * 32 < 2^31.
 *
 * Rows of x go R at a time (a compile-time count: their integer sums live in registers); the tile's
 * codes, a few KB, stay in L1 between the passes. The 256-bit paths take a tile as two halves of 8
 * rows (the 32-byte half of each 64-byte chunk) and keep the fp32 sums in y itself: 16 ymm registers
 * hold 4 rows' integer sums and the codes, not their fp32 sums as well (llvm-mca counted 64 spill
 * moves per block of 4 rows when they did).
 */
#include "cpu_tiles.h"

#if LB_ISA == 3
/* ---- 512 bits: 16 rows of a tile per vector, fp32 sums in registers ---- */

static inline __attribute__((always_inline)) void int4_pass(const int R, int64_t m0, const lowbit_linear *w,
                                                            const lowbit_qact *a, const uint8_t *tile, int64_t n0,
                                                            float *y) {
    const int64_t G = w->K / w->group, nbg = w->group / 32, P = w->P;
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    lowbit_group_walk walk = lowbit_walk(w, tile);
    for (int64_t gi = 0; gi < G; lowbit_walk_next(&walk, gi++)) {
        const uint8_t *unit = lowbit_walk_scales(&walk, gi), *codes = lowbit_walk_codes(&walk, gi);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)unit));
        const __m512 mn = P == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + 32))) : d;
        for (int64_t bb = 0; bb < nbg; bb++) {
            const int64_t b = gi * nbg + bb;
            __m512i th[4], tl[4];
            for (int r = 0; r < R; r++) th[r] = tl[r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(codes + bb * 256 + 64 * j);
                planes_dot(R, th, tl, _mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), a, m0,
                           b, j);
            }
            for (int r = 0; r < R; r++) {
                const lowbit_qblock q = a->blk[(m0 + r) * a->nb + b];
                __m512i T = _mm512_add_epi32(_mm512_slli_epi32(th[r], 8), tl[r]);
                if (P == 1) T = _mm512_sub_epi32(T, _mm512_set1_epi32(q.S8));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(T), _mm512_mul_ps(d, _mm512_set1_ps(q.s))));
                if (P == 2) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mn, _mm512_set1_ps(q.sS)));
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (m0 + r) * w->N + n0, acc[r]);
}

static inline __attribute__((always_inline)) void int8_pass(const int R, int64_t m0, const lowbit_linear *w,
                                                            const lowbit_qact *a, const uint8_t *tile, int64_t n0,
                                                            float *y) {
    const int64_t G = w->K / w->group, nbg = w->group / 32, P = w->P;
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    lowbit_group_walk walk = lowbit_walk(w, tile);
    for (int64_t gi = 0; gi < G; lowbit_walk_next(&walk, gi++)) {
        const uint8_t *unit = lowbit_walk_scales(&walk, gi), *codes = lowbit_walk_codes(&walk, gi);
        const __m512 d = P == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)unit))
                                : _mm512_loadu_ps((const float *)unit);
        for (int64_t bb = 0; bb < nbg; bb++) {
            const int64_t b = gi * nbg + bb;
            __m512i th[4], tl[4];
            for (int r = 0; r < R; r++) th[r] = tl[r] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                const __m512i v = _mm512_loadu_si512(codes + bb * 512 + 64 * j);
                for (int r = 0; r < R; r++) {
                    const int8_t *p = HL(a, m0 + r, b, j, 4);  /* h, l of k 4j..4j+3 */
                    th[r] = dpbusd_b(th[r], v, p);
                    tl[r] = dpbusd_b(tl[r], v, p + 4);
                    KEEP(th[r]);
                    KEEP(tl[r]);
                }
            }
            for (int r = 0; r < R; r++) {
                const lowbit_qblock q = a->blk[(m0 + r) * a->nb + b];
                const __m512i T = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(th[r], 8), tl[r]),
                                                   _mm512_set1_epi32(q.S128));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(T), _mm512_mul_ps(d, _mm512_set1_ps(q.s))));
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (m0 + r) * w->N + n0, acc[r]);
}

/* The entry for one kind (int4, int8): rows m0..m0+mc against tiles t0..t1-1, a tile's rows in passes. */
#define TILES_ENTRY(kind)                                                                                 \
    void NAME(lowbit_##kind##_tiles)(const lowbit_linear *w, const lowbit_qact *a, int64_t m0, int64_t mc, \
                                     int64_t t0, int64_t t1, float *y) {                                  \
        const int64_t tile_bytes = lowbit_tile_bytes(w);                                                  \
        for (int64_t t = t0; t < t1; t++) {                                                               \
            const uint8_t *tile = w->data + t * tile_bytes;                                               \
            ROW_PASSES(kind##_pass, m0, mc, w, a, tile, t * LOWBIT_TILE, y)                               \
        }                                                                                                 \
    }

TILES_ENTRY(int4)
TILES_ENTRY(int8)

#else
/* ---- 256 bits: a tile as two halves of 8 rows, fp32 sums in y ---- */
/* One or two rows of x go over the whole tile at once (`*_full`, H = 2 halves), so each activation
 * broadcast serves 16 rows (A/B alternated in one process, AVX2, the 1.7B-shape model's int4 weights
 * at one row: +31% GB/s; 2 rows +14%); more rows go over each half in turn (`*_half`: the same loops
 * with H = 1), their sums in the 16 registers (both halves at once measured 12-20% slower at 4 and 16
 * rows). */

/* The int4 epilogue (the file's comment) for 8 rows: y[0..8) += T's block. */
static inline void int4_epilogue(float *yo, __m256i T, __m256 d, __m256 mn, int64_t P, lowbit_qblock q) {
    if (P == 1) T = _mm256_sub_epi32(T, _mm256_set1_epi32(q.S8));
    __m256 acc = _mm256_add_ps(_mm256_loadu_ps(yo), _mm256_mul_ps(_mm256_cvtepi32_ps(T), _mm256_mul_ps(d, _mm256_set1_ps(q.s))));
    if (P == 2) acc = _mm256_add_ps(acc, _mm256_mul_ps(mn, _mm256_set1_ps(q.sS)));
    _mm256_storeu_ps(yo, acc);
}

/* The int8 epilogue for 8 rows, Tu = sum (q_w + 128) q. */
static inline void int8_epilogue(float *yo, __m256i Tu, __m256 d, lowbit_qblock q) {
    const __m256i T = _mm256_sub_epi32(Tu, _mm256_set1_epi32(q.S128));
    _mm256_storeu_ps(yo, _mm256_add_ps(_mm256_loadu_ps(yo), _mm256_mul_ps(_mm256_cvtepi32_ps(T),
                                                                          _mm256_mul_ps(d, _mm256_set1_ps(q.s)))));
}

static inline __attribute__((always_inline)) void int4_full(const int R, const int H, int64_t m0,
                                                            const lowbit_linear *w, const lowbit_qact *a,
                                                            const uint8_t *tile, int64_t n0, int half0, float *y) {
    const int64_t G = w->K / w->group, nbg = w->group / 32, P = w->P, N = w->N;
    const __m256i low4 = _mm256_set1_epi8(15);
    float *yr = zeroed_rows(y + m0 * N + n0 + 8 * half0, R, H, N);
    lowbit_group_walk walk = lowbit_walk(w, tile);
    for (int64_t gi = 0; gi < G; lowbit_walk_next(&walk, gi++)) {
        const uint8_t *unit = lowbit_walk_scales(&walk, gi), *codes = lowbit_walk_codes(&walk, gi) + 32 * half0;
        __m256 d[2], mn[2];
        for (int h = 0; h < H; h++) {
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 16 * (half0 + h))));
            mn[h] = P == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 32 + 16 * (half0 + h)))) : d[h];
        }
        for (int64_t bb = 0; bb < nbg; bb++) {
            const int64_t b = gi * nbg + bb;
            __m256i th[2][4], tl[2][4];
            for (int h = 0; h < H; h++)
                for (int r = 0; r < R; r++) th[h][r] = tl[h][r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                __m256i lo[2], hi[2];
                for (int h = 0; h < H; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + bb * 256 + 64 * j + 32 * h));
                    lo[h] = _mm256_and_si256(v, low4), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                }
                planes_dot(R, H, th, tl, lo, hi, a, m0, b, j);
            }
            for (int r = 0; r < R; r++) {
                const lowbit_qblock q = a->blk[(m0 + r) * a->nb + b];
                for (int h = 0; h < H; h++) int4_epilogue(yr + r * N + 8 * h, planes_sum(th[h][r], tl[h][r]), d[h], mn[h], P, q);
            }
        }
    }
}

static inline __attribute__((always_inline)) void int8_full(const int R, const int H, int64_t m0,
                                                            const lowbit_linear *w, const lowbit_qact *a,
                                                            const uint8_t *tile, int64_t n0, int half0, float *y) {
    const int64_t G = w->K / w->group, nbg = w->group / 32, P = w->P, N = w->N;
    float *yr = zeroed_rows(y + m0 * N + n0 + 8 * half0, R, H, N);
    lowbit_group_walk walk = lowbit_walk(w, tile);
    for (int64_t gi = 0; gi < G; lowbit_walk_next(&walk, gi++)) {
        const uint8_t *unit = lowbit_walk_scales(&walk, gi), *codes = lowbit_walk_codes(&walk, gi) + 32 * half0;
        __m256 d[2];
        for (int h = 0; h < H; h++)
            d[h] = P == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 16 * (half0 + h))))
                          : _mm256_loadu_ps((const float *)unit + 8 * (half0 + h));
        for (int64_t bb = 0; bb < nbg; bb++) {
            const int64_t b = gi * nbg + bb;
            __m256i ta[2][4], tb[2][4];
            for (int h = 0; h < H; h++)
                for (int r = 0; r < R; r++) ta[h][r] = tb[h][r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
#if LB_ISA == 1
                /* per half, rows 0-3 and 4-7, 4 k each, as int16; x's 4 codes broadcast as 64 bits */
                __m256i ua[2], ub[2];
                for (int h = 0; h < H; h++) {
                    const uint8_t *c = codes + bb * 512 + 64 * j + 32 * h;
                    ua[h] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)c));
                    ub[h] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
                }
                for (int r = 0; r < R; r++) {
                    const __m256i xq = _mm256_set1_epi64x(load64(a->q + (m0 + r) * a->K + b * 32 + 4 * j));
                    for (int h = 0; h < H; h++) {
                        ta[h][r] = _mm256_add_epi32(ta[h][r], _mm256_madd_epi16(ua[h], xq));
                        tb[h][r] = _mm256_add_epi32(tb[h][r], _mm256_madd_epi16(ub[h], xq));
                        KEEP(ta[h][r]);
                        KEEP(tb[h][r]);
                    }
                }
#else
                __m256i v[2];
                for (int h = 0; h < H; h++) v[h] = _mm256_loadu_si256((const __m256i *)(codes + bb * 512 + 64 * j + 32 * h));
                for (int r = 0; r < R; r++) {
                    const int8_t *p = HL(a, m0 + r, b, j, 4);
                    const __m256i hq = _mm256_set1_epi32(load32(p)), lq = _mm256_set1_epi32(load32(p + 4));
                    for (int h = 0; h < H; h++) {
                        ta[h][r] = DPBUSD256(ta[h][r], v[h], hq);
                        tb[h][r] = DPBUSD256(tb[h][r], v[h], lq);
                        KEEP(ta[h][r]);
                        KEEP(tb[h][r]);
                    }
                }
#endif
            }
            for (int r = 0; r < R; r++) {
                const lowbit_qblock q = a->blk[(m0 + r) * a->nb + b];
                for (int h = 0; h < H; h++)
#if LB_ISA == 1
                    int8_epilogue(yr + r * N + 8 * h, pairs_sum(ta[h][r], tb[h][r]), d[h], q);
#else
                    int8_epilogue(yr + r * N + 8 * h, planes_sum(ta[h][r], tb[h][r]), d[h], q);
#endif
            }
        }
    }
}

/* More rows go over each half in turn: the same loops with one half (H = 1), their sums in the 16 registers. */
static inline __attribute__((always_inline)) void int4_half(const int R, int64_t m0, const lowbit_linear *w,
                                                            const lowbit_qact *a, const uint8_t *tile, int64_t n0,
                                                            int half, float *y) {
    int4_full(R, 1, m0, w, a, tile, n0, half, y);
}

static inline __attribute__((always_inline)) void int8_half(const int R, int64_t m0, const lowbit_linear *w,
                                                            const lowbit_qact *a, const uint8_t *tile, int64_t n0,
                                                            int half, float *y) {
    int8_full(R, 1, m0, w, a, tile, n0, half, y);
}

/* The entry for one kind (int4, int8). One or two rows run whole tiles in a function of their own, so
 * that the half passes compile as they do alone (inlined into the same function they ran 12% slower at
 * 4 and 16 rows); more rows run each tile's halves in passes. */
#define TILES_ENTRY(kind)                                                                                 \
    static __attribute__((noinline)) void kind##_full_tiles(const lowbit_linear *w, const lowbit_qact *a,  \
                                                            int64_t m0, int64_t mc, int64_t t0, int64_t t1, \
                                                            float *y) {                                   \
        const int64_t tile_bytes = lowbit_tile_bytes(w);                                                  \
        for (int64_t t = t0; t < t1; t++) {                                                               \
            const uint8_t *tile = w->data + t * tile_bytes;                                               \
            if (mc == 2) kind##_full(2, 2, m0, w, a, tile, t * LOWBIT_TILE, 0, y);                        \
            else kind##_full(1, 2, m0, w, a, tile, t * LOWBIT_TILE, 0, y);                                \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    void NAME(lowbit_##kind##_tiles)(const lowbit_linear *w, const lowbit_qact *a, int64_t m0, int64_t mc, \
                                     int64_t t0, int64_t t1, float *y) {                                  \
        if (mc <= 2) {                                                                                    \
            kind##_full_tiles(w, a, m0, mc, t0, t1, y);                                                   \
            return;                                                                                       \
        }                                                                                                 \
        const int64_t tile_bytes = lowbit_tile_bytes(w);                                                  \
        for (int64_t t = t0; t < t1; t++) {                                                               \
            const uint8_t *tile = w->data + t * tile_bytes;                                               \
            for (int half = 0; half < 2; half++)                                                          \
                ROW_PASSES(kind##_half, m0, mc, w, a, tile, t * LOWBIT_TILE, half, y)                     \
        }                                                                                                 \
    }

TILES_ENTRY(int4)
TILES_ENTRY(int8)
#endif
