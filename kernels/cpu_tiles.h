/* What the per-instruction-set tile kernels share (cpu_wq_tiles.c: int4/int8 tiles; cpu_kq_tiles.c:
 * GGML blocks in tiles): each is compiled once per instruction set with -DLB_ISA=1 (AVX2), 2 (256-bit
 * VNNI) or 3 (AVX-512 VNNI), and this header gives its exported names that set's suffix and the
 * small pieces of every pass — the dot-product step, the passes over R rows, where an activation
 * word is. */
#ifndef LOWBIT_CPU_TILES_H
#define LOWBIT_CPU_TILES_H
#include <immintrin.h>
#include <string.h>

#include "cpu_kernels.h"

#if LB_ISA == 1
#define NAME(f) f##_avx2
#elif LB_ISA == 2
#define NAME(f) f##_vnni256
#if defined(__AVXVNNI__)
#define DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif
#elif LB_ISA == 3
#define NAME(f) f##_avx512
#else
#error "compile with -DLB_ISA=1, 2 or 3"
#endif
#define RMAX 4  /* rows of x per pass */

static inline int32_t load32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline int64_t load64(const void *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Integer adds are associative, so GCC regroups a pass's chains of them: it forms every product of the
 * block first and spills them (llvm-mca: 63 spill moves per block of 4 rows). Passing an accumulator
 * through an empty asm after each step keeps the sums in order and the products in registers. */
#define KEEP(v) __asm__("" : "+v"(v))  /* any vector register: all 32 with AVX-512 */

/* Rows m0..m0+mc in passes of at most RMAX, each pass a compile-time R. */
#define ROW_PASSES(F, m0, mc, ...)                                            \
    for (int64_t r0 = (m0); r0 < (m0) + (mc); r0 += RMAX) {                   \
        const int64_t rc = (m0) + (mc) - r0 < RMAX ? (m0) + (mc) - r0 : RMAX; \
        if (rc == 4) F(4, r0, __VA_ARGS__);                                   \
        else if (rc == 3) F(3, r0, __VA_ARGS__);                              \
        else if (rc == 2) F(2, r0, __VA_ARGS__);                              \
        else F(1, r0, __VA_ARGS__);                                           \
    }

/* Rows m0..m0+mc: passes of 8 rows by F8 (AVX-512's prompt passes) while 8 remain, the rest as
 * ROW_PASSES does by F. The two give a row the same bits: the same integer sums, the same epilogue. */
#define ROW_PASSES8(F8, F, m0, mc, ...)                                       \
    {                                                                         \
        int64_t r8 = (m0);                                                    \
        for (; r8 + 8 <= (m0) + (mc); r8 += 8) F8(8, r8, __VA_ARGS__);        \
        ROW_PASSES(F, r8, (m0) + (mc) - r8, __VA_ARGS__)                      \
    }

/* The activation words one row's pass reads: hl of block b, 8 k group j (int4) or 4 k group j (int8). */
#define HL(a, row, b, j, kper) ((a)->hl + 2 * ((row) * (a)->K + (b) * 32 + (kper) * (j)))

#if LB_ISA == 3
/* acc += u . (the 4 bytes at p, broadcast): vpdpbusd with its memory operand broadcast ({1to16}),
 * one instruction where GCC emits a vpbroadcastd and a vpdpbusd (measured in one process, A/B
 * alternated: +5% GB/s at one row on the 1.7B-shape model's weights, +7% at 16 rows). */
#if defined(__GNUC__) && !defined(__clang__)
static inline __m512i dpbusd_b(__m512i acc, __m512i u, const void *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}
#else
static inline __m512i dpbusd_b(__m512i acc, __m512i u, const void *p) {
    return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(load32(p)));
}
#endif

/* One 64-byte chunk j of a block's int4-style codes against R rows: the low nibbles (k 8j..8j+3) and the
 * high ones (k 8j+4..8j+7) times each row's h and l planes, into its th and tl sums. */
static inline __attribute__((always_inline)) void planes_dot(const int R, __m512i *th, __m512i *tl, __m512i lo,
                                                             __m512i hi, const lowbit_qact *a, int64_t m0,
                                                             int64_t b, int j) {
    for (int r = 0; r < R; r++) {
        const int8_t *p = HL(a, m0 + r, b, j, 8);  /* h, l of k 8j..8j+3, then of 8j+4..8j+7 */
        th[r] = dpbusd_b(th[r], lo, p);
        tl[r] = dpbusd_b(tl[r], lo, p + 4);
        th[r] = dpbusd_b(th[r], hi, p + 8);
        tl[r] = dpbusd_b(tl[r], hi, p + 12);
        KEEP(th[r]);
        KEEP(tl[r]);
    }
}
#else
/* acc + the products of u8 codes and s8 activations, 4 by 4 (int16 pair sums on AVX2, int32 with VNNI). */
#if LB_ISA == 1
#define MADD4(acc, u, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, x))
#else
#define MADD4(acc, u, x) DPBUSD256(acc, u, x)
#endif

/* A block's integer sum T = 256 sum(u h) + sum(u l) of 8 rows from the planes' accumulators. */
static inline __m256i planes_sum(__m256i th, __m256i tl) {
#if LB_ISA == 1
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(th, ones), 8), _mm256_madd_epi16(tl, ones));
#else
    return _mm256_add_epi32(_mm256_slli_epi32(th, 8), tl);
#endif
}

/* The same on 256 bits: chunk j's two halves (H of them, lo[h], hi[h]) against R rows, each broadcast
 * of a row's activation words serving every half. */
static inline __attribute__((always_inline)) void planes_dot(const int R, const int H, __m256i th[][4],
                                                             __m256i tl[][4], const __m256i *lo, const __m256i *hi,
                                                             const lowbit_qact *a, int64_t m0, int64_t b, int j) {
    for (int r = 0; r < R; r++) {
        const int8_t *p = HL(a, m0 + r, b, j, 8);
        const __m256i h0 = _mm256_set1_epi32(load32(p)), l0 = _mm256_set1_epi32(load32(p + 4));
        const __m256i h1 = _mm256_set1_epi32(load32(p + 8)), l1 = _mm256_set1_epi32(load32(p + 12));
        for (int h = 0; h < H; h++) {  /* each broadcast serves both halves */
            th[h][r] = MADD4(MADD4(th[h][r], lo[h], h0), hi[h], h1);
            tl[h][r] = MADD4(MADD4(tl[h][r], lo[h], l0), hi[h], l1);
        }
        for (int h = 0; h < H; h++) {
            KEEP(th[h][r]);
            KEEP(tl[h][r]);
        }
    }
}

/* Rows 0-7 of an 8-row half from vpmaddwd's pair sums: lanes [r0 r0 r1 r1 | r2 r2 r3 r3] (ta) and
 * rows 4-7 alike (tb) — pair sums, then rows in order (AVX2's int8 path, and its 5- and 6-bit codes). */
static inline __m256i pairs_sum(__m256i ta, __m256i tb) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(ta, tb), 0xD8);
}

/* The R rows x H halves of y a pass sums into (rows N floats apart), set to 0 → yr. */
static inline float *zeroed_rows(float *yr, const int R, const int H, int64_t N) {
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) _mm256_storeu_ps(yr + r * N + 8 * h, _mm256_setzero_ps());
    return yr;
}

#endif
#endif
