/* GGML's K-quant, 5-bit and MXFP4 blocks in lowbit's tiles (kind 4 of cpu_kernels.h): the repack at load (a
 * file's rows of blocks → tiles of 16 rows, lossless: every code and scale is kept, and the bytes are
 * the file's, Q6_K's header padded to a 64-byte line: 1.0095x; Q4_0, Q4_1 and Q8_0 go into the int4 and
 * int8 tiles the same way, what kernels/int4_mm.py and int8_mm.py pack from their codes), the check the
 * matmul makes, and the exact path's fp32 rows (the embedding lookup too), bit for bit
 * gguf.quants.dequantize. kernels/kq_mm.py is the spec of the layout (kq_pack_ref) and of the rows
 * (kq_dequant_ref); cpu_kq_tiles.c multiplies it.
 *
 * A group's header (16 rows r; kq_mm.py):
 *   Q4_K, Q5_K  d fp16 [16] | dmin fp16 [16] | the 12 packed scale bytes, byte i of row r at 64 + 16 i + r
 *   Q6_K        d fp16 [16] | scales int8, sub-block s of row r at 32 + 16 s + r | 32 zero bytes
 *   Q5_0        d fp16 [16]
 *   Q5_1        d fp16 [16] | m fp16 [16]
 *   MXFP4       E8M0 exponent bytes, block b of the group (of 2) of row r at 16 b + r
 * and per block of 32 its codes (cpu_kernels.h). MXFP4's group is two of its 17-byte blocks, so the tiles
 * hold its 34 bytes per 64 weights of a row in 32 + 2 x 16: the file's size, 4.25 bits a weight (plus an
 * odd last group's 32 bytes of padding per 16 rows, kernels/tile_layout.py). */
#define _XOPEN_SOURCE 700  /* pread */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_kernels.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  /* GGUF blocks that move into the int4 / int8 tiles (kinds 1, 2) */

/* Values per group (a GGUF block; MXFP4: two, for a 32-byte header) and the file's bytes per group, by type. */
static int64_t group_of(int64_t t) {
    return t == LOWBIT_Q4_K || t == LOWBIT_Q5_K || t == LOWBIT_Q6_K ? 256 : t == LOWBIT_MXFP4 ? 64 : 32;
}
static int64_t file_bytes(int64_t t) {
    switch (t) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q8_0: return 34;
        case LOWBIT_Q4_K: return 144;
        case LOWBIT_Q5_K: return 176;
        case LOWBIT_Q6_K: return 210;
        case LOWBIT_Q5_0: return 22;
        case LOWBIT_Q5_1: return 24;
        case LOWBIT_MXFP4: return 2 * 17;
        default: return 0;
    }
}

int lowbit_kq_check(const lowbit_linear *w) {
    if (w->kind != 4 || !w->data || !lowbit_kq_header(w->P) || w->group != group_of(w->P) || w->N < 1 ||
        w->N % LOWBIT_TILE || w->K < 1 || w->K % w->group)
        return -1;
    return 0;
}

/* One GGUF block p of type t → its unsigned codes u [group]: 4, 5 or 6 bits (w = a u + b per sub-block),
 * 32 at a time in AVX2 registers (a load's repack is a pass over every weight: 4.35 GB at 8B). */
static inline __attribute__((always_inline)) void block_codes(const int64_t t, const uint8_t *p, uint8_t *u) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
#define LOAD(q) _mm256_loadu_si256((const __m256i *)(q))
#define STORE(q, v) _mm256_storeu_si256((__m256i *)(q), v)
#define BYTES_SRL(v, n) _mm256_srli_epi16(v, n) /* masked by the caller: bits crossing bytes are dropped */
    if (t == LOWBIT_Q4_K || t == LOWBIT_Q5_K) {
        const __m256i qh = LOAD(p + 16);
        const uint8_t *qs = p + (t == LOWBIT_Q5_K ? 48 : 16);
        for (int c = 0; c < 4; c++) {  /* 64 values per 32 bytes: low nibbles, then high */
            const __m256i b = LOAD(qs + 32 * c);
            __m256i lo = _mm256_and_si256(b, m15), hi = _mm256_and_si256(BYTES_SRL(b, 4), m15);
            if (t == LOWBIT_Q5_K) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(BYTES_SRL(qh, 2 * c), m1), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(BYTES_SRL(qh, 2 * c + 1), m1), 4));
            }
            STORE(u + 64 * c, lo), STORE(u + 64 * c + 32, hi);
        }
    } else if (t == LOWBIT_Q6_K) {
        for (int n = 0; n < 2; n++) {  /* 128 values: ql 64 bytes, qh 32 */
            const __m256i l0 = LOAD(p + 64 * n), l1 = LOAD(p + 64 * n + 32), qh = LOAD(p + 128 + 32 * n);
            const __m256i lo[4] = {_mm256_and_si256(l0, m15), _mm256_and_si256(l1, m15),
                                   _mm256_and_si256(BYTES_SRL(l0, 4), m15), _mm256_and_si256(BYTES_SRL(l1, 4), m15)};
            for (int s = 0; s < 4; s++)
                STORE(u + 128 * n + 32 * s,
                      _mm256_or_si256(lo[s], _mm256_slli_epi16(_mm256_and_si256(BYTES_SRL(qh, 2 * s), m3), 4)));
        }
    } else if (t == Q4_0 || t == Q4_1) {  /* element j in the low nibble, j + 16 in the high */
        const __m128i q = _mm_loadu_si128((const __m128i *)(p + (t == Q4_0 ? 2 : 4)));
        const __m128i lo = _mm_and_si128(q, _mm256_castsi256_si128(m15));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm256_castsi256_si128(m15));
        _mm_storeu_si128((__m128i *)u, lo), _mm_storeu_si128((__m128i *)(u + 16), hi);
    } else if (t == LOWBIT_MXFP4) {  /* two blocks: e, then 16 bytes, element j low nibble, j + 16 high */
        for (int b = 0; b < 2; b++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(p + 17 * b + 1));
            const __m128i lo = _mm_and_si128(q, _mm256_castsi256_si128(m15));
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm256_castsi256_si128(m15));
            _mm_storeu_si128((__m128i *)(u + 32 * b), lo), _mm_storeu_si128((__m128i *)(u + 32 * b + 16), hi);
        }
    } else if (t == Q8_0) {  /* int8 q, stored as q + 128 for the unsigned operand */
        STORE(u, _mm256_xor_si256(LOAD(p + 2), _mm256_set1_epi8((char)0x80)));
    } else {  /* Q5_0, Q5_1: qh a little-endian u32, then 16 bytes of nibbles */
        const uint8_t *q = p + (t == LOWBIT_Q5_0 ? 2 : 4);
        uint32_t qh;
        memcpy(&qh, q, 4);
        for (int i = 0; i < 16; i++) {
            u[i] = (q[4 + i] & 15) | ((qh >> i) & 1) << 4;
            u[16 + i] = (q[4 + i] >> 4) | ((qh >> (16 + i)) & 1) << 4;
        }
    }
#undef LOAD
#undef STORE
#undef BYTES_SRL
}

/* Row r's part of a group's header, from its GGUF block p. */
static inline __attribute__((always_inline)) void put_header(const int64_t t, const uint8_t *p, uint8_t *hdr, int r) {
    switch (t) {
        case LOWBIT_Q4_K: case LOWBIT_Q5_K:
            memcpy(hdr + 2 * r, p, 2), memcpy(hdr + 32 + 2 * r, p + 2, 2);
            for (int i = 0; i < 12; i++) hdr[64 + 16 * i + r] = p[4 + i];
            return;
        case LOWBIT_Q6_K:
            memcpy(hdr + 2 * r, p + 208, 2);
            for (int s = 0; s < 16; s++) hdr[32 + 16 * s + r] = p[192 + s];
            return;
        case LOWBIT_MXFP4:  /* the two blocks' exponent bytes */
            hdr[r] = p[0], hdr[16 + r] = p[17];
            return;
        case LOWBIT_Q5_1: case Q4_1:
            memcpy(hdr + 32 + 2 * r, p + 2, 2);
            /* fall through */
        default:  /* Q5_0, Q4_0, Q8_0: d only */
            memcpy(hdr + 2 * r, p, 2);
    }
}

/* Row r's codes u [group] into the group's blocks of code bytes (cpu_kernels.h kind 4). Per block of 32:
 * the nibble bytes [j][r][i] = u[8j + i] | u[8j + 4 + i] << 4 by two byte shuffles; the high-bit planes'
 * byte [r][i] gathers bit 4 (and 5) of u[4v + i] for v = 0..7 — for 5-bit codes a movemask puts bit 4 of
 * every u in one word, whose bits i, i + 4, ... pext collects (BMI2, every AVX2 CPU has it); for 6-bit
 * ones, shifts and ORs of the half's four words (a pext per byte ran Q6_K's repack at 1.9 GB/s). */
static inline __attribute__((always_inline)) void put_codes(const int64_t t, const uint8_t *u, uint8_t *codes, int r) {
    if (t == Q8_0) {  /* int8 tiles: byte [j][r][i] = u[4j + i], 8 chunks of 64 bytes */
        for (int j = 0; j < 8; j++) memcpy(codes + 64 * j + 4 * r, u + 4 * j, 4);
        return;
    }
    const int64_t BB = t == Q4_0 || t == Q4_1 ? 256 : lowbit_kq_block(t), nb = group_of(t) / 32;
    const __m128i first = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m128i m15 = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        const __m256i ub = _mm256_loadu_si256((const __m256i *)(u + 32 * b));
        const __m128i u0 = _mm256_castsi256_si128(ub), u1 = _mm256_extracti128_si256(ub, 1);
        /* bytes k of the block in (j, i) order: k = 8j + i (A) and 8j + 4 + i (B), j 0-1 from u0, 2-3 from u1 */
        const __m128i idx = _mm_and_si128(first, m15);
        const __m128i A = _mm_unpacklo_epi64(_mm_shuffle_epi8(u0, idx), _mm_shuffle_epi8(u1, idx));
        const __m128i idxb = _mm_add_epi8(idx, _mm_set1_epi8(4));
        const __m128i B = _mm_unpacklo_epi64(_mm_shuffle_epi8(u0, idxb), _mm_shuffle_epi8(u1, idxb));
        const __m128i nib = _mm_or_si128(_mm_and_si128(A, m15), _mm_slli_epi16(_mm_and_si128(B, m15), 4));
        uint8_t *cb = codes + b * BB;
        uint32_t words[4];
        _mm_storeu_si128((__m128i *)words, nib);
        for (int j = 0; j < 4; j++) memcpy(cb + 64 * j + 4 * r, &words[j], 4);
        if (t == LOWBIT_Q4_K || t == Q4_0 || t == Q4_1 || t == LOWBIT_MXFP4) continue;
        if (t != LOWBIT_Q6_K) {
            const uint32_t b4 = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(ub, 3));  /* bit k: bit 4 of u[k] */
            for (int i = 0; i < 4; i++) cb[256 + 4 * r + i] = (uint8_t)_pext_u32(b4, 0x11111111u << i);
            continue;
        }
        /* plane h: byte i = sum over v of f(u[16 h + 4 v + i]) << 2 v, f = bits 4-5: the half's 16 bytes as
         * four words, each shifted by 2 v (f <= 3, so nothing crosses a byte) and OR-ed into the first */
        for (int h = 0; h < 2; h++) {
            const __m128i f = _mm_and_si128(_mm_srli_epi16(h ? u1 : u0, 4), _mm_set1_epi8(3));
            const __m128i p = _mm_or_si128(_mm_or_si128(f, _mm_slli_epi32(_mm_srli_si128(f, 4), 2)),
                                           _mm_or_si128(_mm_slli_epi32(_mm_srli_si128(f, 8), 4),
                                                        _mm_slli_epi32(_mm_srli_si128(f, 12), 6)));
            const uint32_t word = (uint32_t)_mm_cvtsi128_si32(p);
            memcpy(cb + 256 + 64 * h + 4 * r, &word, 4);
        }
    }
}

/* One tile: rows[r] the GGUF bytes of its row r (r < n <= 16) → out. Rows past n are zero weights, as
 * kernels/int4_mm.py and int8_mm.py pad them (int4: codes 8; int8: codes 128, q = 0; scales 0). */
static inline __attribute__((always_inline)) void pack_tile_of(const int64_t t, const lowbit_linear *w,
                                                                 const uint8_t *const *rows, int64_t n, uint8_t *out) {
    const int64_t G = w->K / w->group, fb = file_bytes(t);
    uint8_t u[256] __attribute__((aligned(32)));
    if (n < LOWBIT_TILE) memset(out, 0, (size_t)lowbit_tile_bytes(w));
    for (int64_t g = 0; g < G; g++) {
        uint8_t *hdr = (uint8_t *)lowbit_group_scales(w, out, g), *codes = (uint8_t *)lowbit_group_codes(w, out, g);
        if (t == LOWBIT_Q6_K) memset(hdr + 288, 0, 32);  /* the header's tail to its line */
        if (lowbit_pair_shift(w) && g == G - 1 && g % 2 == 0) memset(hdr + 32, 0, 32);  /* an odd last group's */
        for (int r = 0; r < n; r++) {
            const uint8_t *p = rows[r] + g * fb;
            put_header(t, p, hdr, r);
            block_codes(t, p, u);
            put_codes(t, u, codes, r);
        }
        if (n < LOWBIT_TILE && (t == Q4_0 || t == Q8_0)) {
            memset(u, t == Q4_0 ? 8 : 128, 32);
            for (int r = (int)n; r < LOWBIT_TILE; r++) put_codes(t, u, codes, r);
        }
    }
}

/* pack_tile_of compiled once per type (a constant t: its decoding inlined, no branch on the type per
 * block): repack of 8192x2048 in memory, 2 threads, AMD EPYC Zen 4: Q4_0 2.8 -> 3.2 GB/s, Q6_K 3.2 -> 3.7. */
static void pack_tile(const lowbit_linear *w, int64_t t, const uint8_t *const *rows, int64_t n, uint8_t *out) {
    switch (t) {
#define TYPE(T) case T: pack_tile_of(T, w, rows, n, out); return;
        TYPE(Q4_0) TYPE(Q4_1) TYPE(Q8_0) TYPE(LOWBIT_Q4_K) TYPE(LOWBIT_Q5_K) TYPE(LOWBIT_Q6_K) TYPE(LOWBIT_Q5_0)
        TYPE(LOWBIT_Q5_1) TYPE(LOWBIT_MXFP4)
#undef TYPE
        default: return;
    }
}

/* The tiles GGUF rows of type t go into: Q4_0 / Q4_1 the int4 ones (kind 1, P 1 / 2), Q8_0 the int8
 * ones (kind 2, fp16 scales), the K-quant and 5-bit types kind 4; kind -1 for a type or shape they
 * do not take. */
static lowbit_linear tiles_for(int64_t t, int64_t N, int64_t K, uint8_t *dst) {
    const int64_t T = (N + LOWBIT_TILE - 1) / LOWBIT_TILE;
    const int64_t kind = t == Q4_0 || t == Q4_1 ? 1 : t == Q8_0 ? 2 : 4, P = t == Q4_0 ? 1 : t == Q4_1 || t == Q8_0 ? 2 : t;
    lowbit_linear w = {kind, T * LOWBIT_TILE, K, group_of(t), P, dst, NULL, 0, 0, NULL, NULL};
    if (N < 1 || (kind == 4 ? lowbit_kq_check(&w) : K % 32 != 0)) w.kind = -1;
    return w;
}

/* File rows a tile's reads may span in one pread: a tile's 16 rows are consecutive in the file, or, for
 * llama Q/K un-permuted at load, 16 of one head's 64-256 rows (every other one): one read instead of 16. */
#define WINDOW 256

/* n bytes at offset of fd → out; 0, or 1 where a read failed or came back short. */
static int read_rows(int fd, int64_t offset, int64_t n, uint8_t *out) {
    for (int64_t got = 0; got < n;) {
        const ssize_t k = pread(fd, out + got, (size_t)(n - got), (off_t)(offset + got));
        if (k <= 0) return 1;
        got += k;
    }
    return 0;
}

/* Rows of type t as GGUF stores them (N rows of K values) → the tiles of tiles_for at dst (ceil(N / 16)
 * tiles of lowbit_tile_bytes each). Output row n is row perm[n] (perm NULL: n) of the source: src in
 * memory, or, src NULL, the rows from byte `offset` of the file fd — each thread then reads its tile's
 * rows (pread: the page cache's copy, into a buffer of its own of up to WINDOW rows), so a load holds the
 * tiles it has made and no copy of the file (a mapping of it would count its pages in the process's
 * memory too).
 * Returns 0, -1 for a type or shape it does not take, -2 for a read that failed or came back short. */
int lowbit_tiles_pack(int64_t t, const uint8_t *src, int fd, int64_t offset, const int64_t *perm, int64_t N,
                      int64_t K, uint8_t *dst, int nthreads) {
    const lowbit_linear w = tiles_for(t, N, K, dst);
    if (w.kind < 0) return -1;
    const int64_t T = w.N / LOWBIT_TILE, tb = lowbit_tile_bytes(&w), row = K / w.group * file_bytes(t);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint8_t *buf = src ? NULL : malloc((size_t)(WINDOW * row));
        failed |= !src && !buf;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < T; tile++) {
            if (failed) continue;
            const int64_t n0 = tile * LOWBIT_TILE, n = N - n0 < LOWBIT_TILE ? N - n0 : LOWBIT_TILE;
            const uint8_t *rows[LOWBIT_TILE];
            int64_t lo = INT64_MAX, hi = -1;  /* the file rows the tile takes */
            for (int64_t r = 0; r < n; r++) {
                const int64_t f = perm ? perm[n0 + r] : n0 + r;
                lo = f < lo ? f : lo, hi = f > hi ? f : hi;
            }
            if (!src && hi - lo < WINDOW) {  /* one read of the window holding them all */
                failed = read_rows(fd, offset + lo * row, (hi - lo + 1) * row, buf);
                for (int64_t r = 0; r < n; r++) rows[r] = buf + ((perm ? perm[n0 + r] : n0 + r) - lo) * row;
            } else {
                for (int64_t r = 0; r < n && !failed; r++) {  /* rows far apart: one read each */
                    const int64_t f = perm ? perm[n0 + r] : n0 + r;
                    rows[r] = src ? src + f * row : buf + r * row;
                    if (!src) failed = read_rows(fd, offset + f * row, row, buf + r * row);
                }
            }
            if (!failed) pack_tile(&w, t, rows, n, dst + tile * tb);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* MXFP4's codebook: E2M1's values doubled (kernels/ggml_blocks.py KVALUES_MXFP4). */
static const int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Row n of w → fp32 out [K], as kernels/ggml_blocks.py computes each type (gguf's arithmetic). */
static void dequant_row(const lowbit_linear *w, int64_t n, float *out) {
    const int64_t t = w->P, G = w->K / w->group, BB = lowbit_kq_block(t), tb = lowbit_tile_bytes(w);
    const int64_t r = n % LOWBIT_TILE;
    const uint8_t *tile = w->data + (n / LOWBIT_TILE) * tb;
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *hdr = lowbit_group_scales(w, tile, g), *codes = lowbit_group_codes(w, tile, g);
        const float d = f16_at(hdr + 2 * r);
        float *o = out + g * w->group;
        for (int64_t b = 0; b < w->group / 32; b++) {
            const uint8_t *cb = codes + b * BB;
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < 2; h++)
                    for (int i = 0; i < 4; i++) {
                        const int k = 8 * j + 4 * h + i, v = 2 * j + h;  /* k in the block, v its nibble vector */
                        int u = (cb[64 * j + 4 * r + i] >> (4 * h)) & 15;
                        if (t == LOWBIT_Q6_K) u |= ((cb[(v < 4 ? 256 : 320) + 4 * r + i] >> (2 * (v & 3))) & 3) << 4;
                        else if (t != LOWBIT_Q4_K && t != LOWBIT_MXFP4) u |= ((cb[256 + 4 * r + i] >> v) & 1) << 4;
                        float x;
                        if (t == LOWBIT_MXFP4) {  /* as gguf: the fp32 power of two times the code, one product */
                            x = lowbit_e8m0_half(hdr[16 * b + r]) * (float)mxfp4_values[u];
                        } else if (t == LOWBIT_Q4_K || t == LOWBIT_Q5_K) {
                            const int64_t jj = b;  /* sub-block of 32 */
                            const uint8_t *q = hdr + 64 + r;
                            int sc, m;
                            if (jj < 4) {
                                sc = q[16 * jj] & 63, m = q[16 * (jj + 4)] & 63;
                            } else {
                                sc = (q[16 * (jj + 4)] & 0xF) | ((q[16 * (jj - 4)] >> 6) << 4);
                                m = (q[16 * (jj + 4)] >> 4) | ((q[16 * jj] >> 6) << 4);
                            }
                            x = d * (float)sc * (float)u - f16_at(hdr + 32 + 2 * r) * (float)m;
                        } else if (t == LOWBIT_Q6_K) {
                            const int8_t sc = (int8_t)hdr[32 + 16 * (2 * b + k / 16) + r];
                            x = d * (float)sc * (float)(u - 32);
                        } else if (t == LOWBIT_Q5_0) {
                            x = d * (float)(u - 16);
                        } else {
                            x = d * (float)u + f16_at(hdr + 32 + 2 * r);
                        }
                        o[32 * b + k] = x;
                    }
        }
    }
}

/* The rows ids[0..n) of a kind-4 weight → fp32 out [n, K] (the embedding lookup; an id outside 0..N-1: -1). */
int lowbit_kq_rows(const lowbit_linear *w, const int64_t *ids, int64_t n, float *out) {
    if (lowbit_kq_check(w)) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= w->N) return -1;
        dequant_row(w, ids[i], out + i * w->K);
    }
    return 0;
}

/* Rows n0..n1-1 → fp32 out [n1 - n0, K] (the exact path), rows shared out over the threads. */
int lowbit_kq_dequant(const lowbit_linear *w, int64_t n0, int64_t n1, float *out, int nthreads) {
    if (lowbit_kq_check(w) || n0 < 0 || n1 > w->N || n0 > n1) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = n0; n < n1; n++) dequant_row(w, n, out + (n - n0) * w->K);
    return 0;
}
