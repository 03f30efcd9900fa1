/* Weight-only int4/int8 matmul for the CPU decode path: y[M, N] = x[M, K] @ dequant(W)[N, K]^T,
 * fp32 in and out, for the few rows of a decode or speculative-verify step (1 <= M <= 16). AVX2 +
 * FMA + F16C; kernels/cpu_native.py builds it and says why it exists.
 *
 * The weights are read in the layouts lowbit already holds (nothing is repacked or copied):
 *   int4: torch 2.13's CPU tile layout (kernels/int4_mm.py): tiles of 32 output rows, byte
 *         [k*16 + d] = row d | row (d+16) << 4; a last tile of 16 rows stores byte [k*8 + j] =
 *         row 2j | row (2j+1) << 4. Scales: fp16 [G, Np, P], P = 2 pairs (d, m): w = d*u + m, or
 *         P = 1 (d): w = d*(u - 8).
 *   int8: group-major codes [G, N, g], fp16 scales [N, G] (or fp32 [N, G]) (kernels/int8_mm.py).
 *
 * Arithmetic: per group, t = sum_k u[k] x[k] and s = sum_k x[k] in fp32, then y += d*t + m*s
 * (int4; m = -8d if symmetric) or y += d*t (int8): the exact fp16 scales and fp32 activations, no
 * bf16 rounding. Each output row is computed by one thread in an order fixed by this code, not by
 * M or the other rows, so row i of an M-row call equals a 1-row call on row i bit for bit
 * (speculative decoding relies on it: a verified token must be the token plain decoding gives).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 8  /* int8: rows per pass; more spill the accumulators out of the 16 ymm (int4's whole-tile form, 1728x576: M = 15 in one pass 1248 us, two passes of <= 8 ~540 us) */
#define INT4_ROWS 16  /* int4: rows per pass (the tile is read once for them, 4 rows at a time from L1) */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int lowbit_native_ok(void) { return 1; }

/* 8 fp16 (d, m) pairs → d, z for 8 rows (z = m), or 8 fp16 d → d, z = -8 d. */
static inline void scales8(const uint16_t *s, int64_t P, __m256 *d, __m256 *z) {
    if (P == 1) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
        *z = _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f));
        return;
    }
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));        /* d0 m0 .. d3 m3 */
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 8)));  /* d4 m4 .. d7 m7 */
    /* per 128-bit lane [a0 a2 b0 b2 | a4 a6 b4 b6] = d0 d1 d4 d5 | d2 d3 d6 d7, then 64-bit order 0 2 1 3 */
    *d = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *z = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

/* One tile of 32 output rows for one row of x (int4_tile32): its 4 + 4 accumulators stay in registers. */
static inline __attribute__((always_inline)) void int4_tile32_m(
        const float *x, const int M, int64_t K, const float *xs, int64_t G, int64_t gs, const uint8_t *tile,
        const uint16_t *sm, int64_t P, int64_t Np, int64_t row0, float *y) {
    __m256 acc[MAX_ROWS][4], ta[MAX_ROWS][4];
    const __m128i low4 = _mm_set1_epi8(15);
    for (int m = 0; m < M; m++)
        for (int i = 0; i < 4; i++) acc[m][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int m = 0; m < M; m++)
            for (int i = 0; i < 4; i++) ta[m][i] = _mm256_setzero_ps();
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(tile + k * 16));
            const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
            const __m256 w[4] = {  /* rows 0-7, 8-15 (low nibbles), 16-23, 24-31 (high) */
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
            for (int m = 0; m < M; m++) {
                const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
                for (int i = 0; i < 4; i++) ta[m][i] = _mm256_fmadd_ps(w[i], xv, ta[m][i]);
            }
        }
        __m256 d[4], z[4];
        for (int i = 0; i < 4; i++) scales8(sm + (g * Np + row0 + 8 * i) * P, P, &d[i], &z[i]);
        for (int m = 0; m < M; m++) {
            const __m256 sx = _mm256_set1_ps(xs[m * G + g]);
            for (int i = 0; i < 4; i++)
                acc[m][i] = _mm256_add_ps(acc[m][i], _mm256_fmadd_ps(d[i], ta[m][i], _mm256_mul_ps(z[i], sx)));
        }
    }
    for (int m = 0; m < M; m++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(y + m * Np + row0 + 8 * i, acc[m][i]);
}

/* Half a tile (16 output rows: the low nibbles, half = 0, or the high ones) for M <= 4 rows of x (a
 * compile-time constant): 2 x M accumulators stay in registers, where a whole tile for more than two
 * rows spilled them (1728x576, M = 8: ~2.5x slower per row than this). The same operations per
 * element, in the same order, as int4_tile32_m: a row's result does not depend on which one ran. */
static inline __attribute__((always_inline)) void int4_half_m(
        const float *x, const int M, int64_t K, const float *xs, int64_t G, int64_t gs, const uint8_t *tile,
        const uint16_t *sm, int64_t P, int64_t Np, int64_t row0, int half, float *y) {
    __m256 acc[4][2], ta[4][2];
    const __m128i low4 = _mm_set1_epi8(15);
    for (int m = 0; m < M; m++)
        for (int i = 0; i < 2; i++) acc[m][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int m = 0; m < M; m++)
            for (int i = 0; i < 2; i++) ta[m][i] = _mm256_setzero_ps();
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(tile + k * 16));
            const __m128i u = half ? _mm_and_si128(_mm_srli_epi16(b, 4), low4) : _mm_and_si128(b, low4);
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u));
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(u, 8)));
            for (int m = 0; m < M; m++) {
                const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
                ta[m][0] = _mm256_fmadd_ps(w0, xv, ta[m][0]);
                ta[m][1] = _mm256_fmadd_ps(w1, xv, ta[m][1]);
            }
        }
        __m256 d[2], z[2];
        for (int i = 0; i < 2; i++) scales8(sm + (g * Np + row0 + 16 * half + 8 * i) * P, P, &d[i], &z[i]);
        for (int m = 0; m < M; m++) {
            const __m256 sx = _mm256_set1_ps(xs[m * G + g]);
            for (int i = 0; i < 2; i++)
                acc[m][i] = _mm256_add_ps(acc[m][i], _mm256_fmadd_ps(d[i], ta[m][i], _mm256_mul_ps(z[i], sx)));
        }
    }
    for (int m = 0; m < M; m++)
        for (int i = 0; i < 2; i++) _mm256_storeu_ps(y + m * Np + row0 + 16 * half + 8 * i, acc[m][i]);
}

#define DISPATCH_M(F, M, ...)                                                                          \
    switch (M) {                                                                                       \
        case 1: F(__VA_ARGS__, 1); break; case 2: F(__VA_ARGS__, 2); break;                            \
        case 3: F(__VA_ARGS__, 3); break; case 4: F(__VA_ARGS__, 4); break;                            \
        case 5: F(__VA_ARGS__, 5); break; case 6: F(__VA_ARGS__, 6); break;                            \
        case 7: F(__VA_ARGS__, 7); break; default: F(__VA_ARGS__, 8); break;                           \
    }

#define HALF(x, K, xs, G, gs, tile, sm, P, Np, row0, h, y, M) int4_half_m(x, M, K, xs, G, gs, tile, sm, P, Np, row0, h, y)

/* One row of x: the whole tile at once (4 accumulators, no spill). More: half tiles, 4 rows at a time
 * (the tile's codes, 9 KB at K = 576, stay in L1 between the passes). */
static void int4_tile32(const float *x, int64_t M, int64_t K, const float *xs, int64_t G, int64_t gs,
                        const uint8_t *tile, const uint16_t *sm, int64_t P, int64_t Np, int64_t row0, float *y) {
    if (M == 1) {
        int4_tile32_m(x, 1, K, xs, G, gs, tile, sm, P, Np, row0, y);
        return;
    }
    for (int h = 0; h < 2; h++)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mc = M - m0 < 4 ? M - m0 : 4;
            switch (mc) {
                case 1: HALF(x + m0 * K, K, xs + m0 * G, G, gs, tile, sm, P, Np, row0, h, y + m0 * Np, 1); break;
                case 2: HALF(x + m0 * K, K, xs + m0 * G, G, gs, tile, sm, P, Np, row0, h, y + m0 * Np, 2); break;
                case 3: HALF(x + m0 * K, K, xs + m0 * G, G, gs, tile, sm, P, Np, row0, h, y + m0 * Np, 3); break;
                default: HALF(x + m0 * K, K, xs + m0 * G, G, gs, tile, sm, P, Np, row0, h, y + m0 * Np, 4); break;
            }
        }
}

/* The last tile when Np % 32 == 16: byte j of column k holds rows 2j (low) and 2j+1 (high). Plain
 * C: it is at most 16 rows of a weight. */
static void int4_tile16(const float *x, int64_t M, int64_t K, const float *xs, int64_t G, int64_t gs,
                        const uint8_t *tile, const uint16_t *sm, int64_t P, int64_t Np, int64_t row0, float *y) {
    float acc[INT4_ROWS][16], ta[INT4_ROWS][16], u[16];
    memset(acc, 0, sizeof(acc));
    for (int64_t g = 0; g < G; g++) {
        memset(ta, 0, sizeof(ta));
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
            for (int j = 0; j < 8; j++) {
                u[2 * j] = (float)(tile[k * 8 + j] & 15);
                u[2 * j + 1] = (float)(tile[k * 8 + j] >> 4);
            }
            for (int64_t m = 0; m < M; m++)
                for (int r = 0; r < 16; r++) ta[m][r] = fmaf(u[r], x[m * K + k], ta[m][r]);
        }
        for (int r = 0; r < 16; r++) {
            const uint16_t *s = sm + (g * Np + row0 + r) * P;
            const float d = _cvtsh_ss(s[0]), z = P == 2 ? _cvtsh_ss(s[1]) : -8.0f * d;
            for (int64_t m = 0; m < M; m++) acc[m][r] += fmaf(d, ta[m][r], z * xs[m * G + g]);
        }
    }
    for (int64_t m = 0; m < M; m++) memcpy(y + m * Np + row0, acc[m], 16 * sizeof(float));
}

/* x fp32 [M, K] (K = G * gs), packed: the tile layout of [Np, K] codes, sm fp16 [G, Np, P] → y fp32
 * [M, Np]. xs: scratch fp32 [M, G] for the group sums of x. Rows go INT4_ROWS at a time. Returns 0,
 * or -1 for a shape it does not take. */
int lowbit_int4_mm(const float *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sm, int64_t P,
                   int64_t Np, int64_t gs, float *xs, float *y, int nthreads) {
    if (M < 1 || gs < 1 || K % gs || Np % 16 || (P != 1 && P != 2)) return -1;
    const int64_t G = K / gs, full = Np / 32, tiles = full + (Np % 32 ? 1 : 0);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += x[m * K + k];
            xs[m * G + g] = s;
        }
    for (int64_t m0 = 0; m0 < M; m0 += INT4_ROWS) {
        const int64_t mc = M - m0 < INT4_ROWS ? M - m0 : INT4_ROWS;
        const float *xc = x + m0 * K, *xsc = xs + m0 * G;
        float *yc = y + m0 * Np;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t t = 0; t < tiles; t++) {
            if (t < full)
                int4_tile32(xc, mc, K, xsc, G, gs, packed + t * K * 16, sm, P, Np, t * 32, yc);
            else
                int4_tile16(xc, mc, K, xsc, G, gs, packed + full * K * 16, sm, P, Np, t * 32, yc);
        }
    }
    return 0;
}

#define ROWS8 16  /* output rows per block of the int8 kernel */

/* Output rows n0..n0+nb of the int8 matmul for M rows of x (M a compile-time constant, as above).
 * Groups outer, rows inner: group gi's codes for the block are one contiguous run of nb * g bytes
 * (row-outer order read G strided runs per row: the LM head took 4.8 ms at M = 1, 17 ms at M = 5). */
static inline __attribute__((always_inline)) void int8_block_m(
        const float *x, const int M, int64_t G, int64_t N, int64_t g, const int8_t *q, const void *scales,
        int scale_f32, int64_t n0, int64_t nb, float *y) {
    __m256 acc[ROWS8][MAX_ROWS];
    float tail[ROWS8][MAX_ROWS];
    const int64_t K = G * g, body = g - g % 16;
    for (int64_t r = 0; r < nb; r++)
        for (int m = 0; m < M; m++) {
            acc[r][m] = _mm256_setzero_ps();
            tail[r][m] = 0.0f;
        }
    for (int64_t gi = 0; gi < G; gi++) {
        for (int64_t r = 0; r < nb; r++) {
            const int64_t n = n0 + r;
            const int8_t *qr = q + (gi * N + n) * g;
            const float s = scale_f32 ? ((const float *)scales)[n * G + gi]
                                      : _cvtsh_ss(((const uint16_t *)scales)[n * G + gi]);
            __m256 t[MAX_ROWS];
            for (int m = 0; m < M; m++) t[m] = _mm256_setzero_ps();
            for (int64_t j = 0; j < body; j += 16) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(qr + j));
                const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                for (int m = 0; m < M; m++) {
                    const float *xr = x + m * K + gi * g + j;
                    t[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), t[m]);
                    t[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t[m]);
                }
            }
            const __m256 sv = _mm256_set1_ps(s);
            for (int m = 0; m < M; m++) {
                float rem = 0.0f;
                for (int64_t j = body; j < g; j++) rem = fmaf((float)qr[j], x[m * K + gi * g + j], rem);
                acc[r][m] = _mm256_fmadd_ps(sv, t[m], acc[r][m]);
                tail[r][m] = fmaf(s, rem, tail[r][m]);
            }
        }
    }
    for (int64_t r = 0; r < nb; r++)
        for (int m = 0; m < M; m++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r][m]);
            float sum = tail[r][m];
            for (int l = 0; l < 8; l++) sum += lanes[l];
            y[m * N + n0 + r] = sum;
        }
}

#define BLOCK8(x, G, N, g, q, scales, scale_f32, n0, nb, y, M) int8_block_m(x, M, G, N, g, q, scales, scale_f32, n0, nb, y)

/* x fp32 [M, G*g], q int8 [G, N, g], scales fp16 [N, G] (scale_f32 = 0) or fp32 [N, G] → y fp32 [M, N]. */
int lowbit_int8_mm(const float *x, int64_t M, int64_t G, int64_t N, int64_t g, const int8_t *q, const void *scales,
                   int scale_f32, float *y, int nthreads) {
    if (M < 1 || g < 1) return -1;
    const int64_t K = G * g, blocks = (N + ROWS8 - 1) / ROWS8;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t mc = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
        const float *xc = x + m0 * K;
        float *yc = y + m0 * N;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * ROWS8, nb = N - n0 < ROWS8 ? N - n0 : ROWS8;
            DISPATCH_M(BLOCK8, mc, xc, G, N, g, q, scales, scale_f32, n0, nb, yc)
        }
    }
    return 0;
}

/* The exact path's weight tile (kernels/int4_mm.py dequantize_packed_t): W^T fp32 [K, Np] from the
 * tile layout, w = d * u + m (P = 2) or (u - 8) * d (P = 1) — one product and one sum, as the torch
 * spec computes them, so the tile is bit-identical to it and the exact path's GEMM sees the same
 * numbers. Groups are split across threads: each reads its groups' codes and scales once and writes
 * whole rows k of the output. */
int lowbit_int4_dequant_t(const uint8_t *packed, const uint16_t *sm, int64_t P, int64_t Np, int64_t K, int64_t gs,
                          float *out, int nthreads) {
    if (gs < 1 || K % gs || Np % 16 || (P != 1 && P != 2)) return -1;
    const int64_t full = Np / 32, G = K / gs;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t g = 0; g < G; g++) {
        const __m128i low4 = _mm_set1_epi8(15);
        const __m256i eight = _mm256_set1_epi32(8);
        for (int64_t t = 0; t < full; t++) {
            __m256 d[4], z[4];
            for (int i = 0; i < 4; i++) scales8(sm + (g * Np + t * 32 + 8 * i) * P, P, &d[i], &z[i]);
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(packed + t * K * 16 + k * 16));
                const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
                const __m256i u[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                                      _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
                float *o = out + k * Np + t * 32;
                for (int i = 0; i < 4; i++) {
                    const __m256 w = P == 2 ? _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(u[i]), d[i]), z[i])
                                            : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u[i], eight)), d[i]);
                    _mm256_storeu_ps(o + 8 * i, w);
                }
            }
        }
        for (int64_t r = 0; r < Np - full * 32; r++) {  /* the last tile of 16 rows: byte j = rows 2j, 2j+1 */
            const int64_t n = full * 32 + r;
            const float dn = _cvtsh_ss(sm[(g * Np + n) * P]), mn = P == 2 ? _cvtsh_ss(sm[(g * Np + n) * P + 1]) : 0.0f;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
                const uint8_t b = packed[full * K * 16 + k * 8 + r / 2], u = r % 2 ? b >> 4 : b & 15;
                out[k * Np + n] = P == 2 ? (float)u * dn + mn : (float)((int)u - 8) * dn;
            }
        }
    }
    return 0;
}

/* The exact path's int8 rows (kernels/int8_mm.py Int8Packed.dequantize): rows n0..n1-1 of W fp32
 * [n1 - n0, G * g] from group-major codes [G, N, g], w = q * d (one product, as the spec). */
int lowbit_int8_dequant(const int8_t *q, const void *scales, int scale_f32, int64_t G, int64_t N, int64_t g,
                        int64_t n0, int64_t n1, float *out, int nthreads) {
    if (n0 < 0 || n1 > N || n0 > n1) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = n0; n < n1; n++)
        for (int64_t gi = 0; gi < G; gi++) {
            const float d = scale_f32 ? ((const float *)scales)[n * G + gi] : _cvtsh_ss(((const uint16_t *)scales)[n * G + gi]);
            const int8_t *c = q + (gi * N + n) * g;
            float *o = out + (n - n0) * G * g + gi * g;
            for (int64_t j = 0; j < g; j++) o[j] = (float)c[j] * d;
        }
    return 0;
}

#else  /* no AVX2/FMA/F16C: report it, and lowbit keeps torch's kernels */
int lowbit_native_ok(void) { return 0; }
int lowbit_int4_mm(void) { return -1; }
int lowbit_int8_mm(void) { return -1; }
int lowbit_int4_dequant_t(void) { return -1; }
int lowbit_int8_dequant(void) { return -1; }
#endif
