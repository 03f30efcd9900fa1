/* The CPU matmul y[M, N] = x[M, K] @ dequant(W)[N, K]^T over lowbit's packed layouts (cpu_kernels.h),
 * for the decode path (any M; decode and speculative verification give 1..16 rows), and the exact
 * path's dequantized weight tiles. kernels/cpu_native.py builds it and says why it exists.
 *
 * The fast path: each row of x is quantized per block of 32 to 16-bit codes (lowbit_quantize_rows,
 * kernels/act_quant.py's spec), the tiles of W are multiplied by integer dot products in the
 * instruction set chosen (cpu_wq_tiles.c: AVX2, 256-bit VNNI, AVX-512 VNNI — every one the same bits),
 * and one fp32 epilogue per block adds them up. Work is split by output tiles, statically over the
 * threads of the parallel region, so each thread streams one contiguous range of the weight.
 *
 * "Team" functions are called by every thread of an enclosing parallel region (a whole decode step
 * runs in one, cpu_block.c) and end in a barrier; lowbit_linear_mm opens a region for one matmul.
 *
 * The exact path (kernels/int4_mm.py, int8_mm.py): W^T or row ranges of W dequantized in fp32 with the
 * file's own scales, one product (and one sum) per weight as the torch specs compute them, so the
 * tiles are bit-identical to theirs; oneDNN's GEMM multiplies them.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#include <immintrin.h>

int lowbit_native_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
}

/* Whether this build has `isa` and the CPU runs it (the build only compiles what the CPU has, but a
 * library copied to another machine must not run an instruction it lacks). */
int lowbit_isa_available(int64_t isa) {
    __builtin_cpu_init();
    switch (isa) {
        case LOWBIT_ISA_AVX2: return lowbit_native_ok();
#if LB_HAVE_VNNI256
        case LOWBIT_ISA_VNNI256:
            return __builtin_cpu_supports("avxvnni") ||
                   (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"));
#endif
#if LB_HAVE_AVX512
        case LOWBIT_ISA_AVX512:
            return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512f");
#endif
        default: return 0;
    }
}

int64_t lowbit_isa_best(void) {
    for (int64_t isa = LOWBIT_ISA_MAX; isa > LOWBIT_ISA_AVX2; isa--)
        if (lowbit_isa_available(isa)) return isa;
    return LOWBIT_ISA_AVX2;
}

/* ---- the ABI (cpu_kernels.h) ---- */

int lowbit_abi_version(void) { return LOWBIT_ABI_VERSION; }

/* Every struct kernels/cpu_native.py mirrors, and every field of each: a field added to one of them
 * belongs here too. Python matches the entries by name, so a field reordered, retyped, added or
 * dropped on one side is caught; one added in C but left out here and in Python is caught by the
 * struct's sizeof, unless it fits in padding (lowbit_block's after eps). */
#define ABI_STRUCT(s) {#s, 0, sizeof(s)}
#define ABI_FIELD(s, f) {#s "." #f, offsetof(s, f), sizeof(((s *)0)->f)}
static const struct {
    const char *name;
    int64_t offset, size;
} abi_layout[] = {
    ABI_STRUCT(lowbit_linear), ABI_FIELD(lowbit_linear, kind), ABI_FIELD(lowbit_linear, N),
    ABI_FIELD(lowbit_linear, K), ABI_FIELD(lowbit_linear, group), ABI_FIELD(lowbit_linear, P),
    ABI_FIELD(lowbit_linear, data), ABI_FIELD(lowbit_linear, bias), ABI_FIELD(lowbit_linear, split),
    ABI_FIELD(lowbit_linear, P2), ABI_FIELD(lowbit_linear, data2), ABI_FIELD(lowbit_linear, next),
    ABI_STRUCT(lowbit_ctx), ABI_FIELD(lowbit_ctx, isa), ABI_FIELD(lowbit_ctx, nthreads),
    ABI_STRUCT(lowbit_block), ABI_FIELD(lowbit_block, dim), ABI_FIELD(lowbit_block, n_heads),
    ABI_FIELD(lowbit_block, n_kv_heads), ABI_FIELD(lowbit_block, head_dim), ABI_FIELD(lowbit_block, hidden),
    ABI_FIELD(lowbit_block, eps), ABI_FIELD(lowbit_block, attn_norm), ABI_FIELD(lowbit_block, ffn_norm),
    ABI_FIELD(lowbit_block, qkv), ABI_FIELD(lowbit_block, o), ABI_FIELD(lowbit_block, gate_up),
    ABI_FIELD(lowbit_block, down), ABI_FIELD(lowbit_block, q_norm), ABI_FIELD(lowbit_block, k_norm),
    ABI_FIELD(lowbit_block, attn_post_norm), ABI_FIELD(lowbit_block, ffn_post_norm), ABI_FIELD(lowbit_block, act),
    ABI_FIELD(lowbit_block, rope), ABI_FIELD(lowbit_block, window), ABI_FIELD(lowbit_block, sinks),
    ABI_STRUCT(lowbit_kv_side), ABI_FIELD(lowbit_kv_side, bits), ABI_FIELD(lowbit_kv_side, group),
    ABI_FIELD(lowbit_kv_side, codes), ABI_FIELD(lowbit_kv_side, scales), ABI_FIELD(lowbit_kv_side, mins),
    ABI_STRUCT(lowbit_moe), ABI_FIELD(lowbit_moe, n_experts), ABI_FIELD(lowbit_moe, dim), ABI_FIELD(lowbit_moe, hidden),
    ABI_FIELD(lowbit_moe, act), ABI_FIELD(lowbit_moe, alpha), ABI_FIELD(lowbit_moe, limit),
    ABI_FIELD(lowbit_moe, gate_up), ABI_FIELD(lowbit_moe, down), ABI_FIELD(lowbit_moe, router),
    ABI_FIELD(lowbit_moe, router_bias), ABI_FIELD(lowbit_moe, k), ABI_FIELD(lowbit_moe, rule),
    ABI_FIELD(lowbit_moe, norm_topk), ABI_FIELD(lowbit_block, moe),
};
#undef ABI_STRUCT
#undef ABI_FIELD

int64_t lowbit_abi_layout(const char **names, int64_t *offsets, int64_t *sizes, int64_t cap) {
    const int64_t n = (int64_t)(sizeof abi_layout / sizeof abi_layout[0]);
    for (int64_t i = 0; i < n && i < cap; i++)
        names[i] = abi_layout[i].name, offsets[i] = abi_layout[i].offset, sizes[i] = abi_layout[i].size;
    return n;
}

/* ---- activations ---- */

static inline size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t lowbit_qact_bytes(int64_t M, int64_t K) {
    const size_t nb = (size_t)(M * (K / LOWBIT_BLOCK));
    return align64(2 * (size_t)(M * K)) + align64(2 * (size_t)(M * K)) + align64(sizeof(lowbit_qblock) * nb) + 64;
}

void lowbit_qact_init(lowbit_qact *a, void *mem, int64_t M, int64_t K) {
    uint8_t *p = (uint8_t *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    a->M = M, a->K = K, a->nb = K / LOWBIT_BLOCK;
    a->hl = (int8_t *)p, p += align64(2 * (size_t)(M * K));
    a->q = (int16_t *)p, p += align64(2 * (size_t)(M * K));
    a->blk = (lowbit_qblock *)p;
}

/* 8 int32 (values in int8 range) of h and 8 of l → 16 int8: h of k 0-3, l of k 0-3, h of k 4-7, l of k 4-7. */
static inline __m128i pack_hl(__m256i h, __m256i l) {
    const __m256i hl = _mm256_packs_epi32(h, l);  /* int16, per lane: h0-3 l0-3 | h4-7 l4-7 */
    return _mm_packs_epi16(_mm256_castsi256_si128(hl), _mm256_extracti128_si256(hl, 1));
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}

/* One block of 32 values of row m → its codes, planes and scalars (kernels/act_quant.py: amax,
 * s = amax / 32512, q = round-half-even(x * (32512 / amax)), both fp32 divisions; amax = 0: all zero). */
void lowbit_quantize_block(const float *xb, const lowbit_qact *a, int64_t m, int64_t b) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i qmax = _mm256_set1_epi32(32512), qmin = _mm256_set1_epi32(-32512), half = _mm256_set1_epi32(128);
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float inv = amax > 0.0f ? 32512.0f / amax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i sum = _mm256_setzero_si256(), first = sum;
    const int64_t o = m * a->K + b * LOWBIT_BLOCK;
    for (int i = 0; i < 4; i++) {
        const __m256i q = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv)), qmin), qmax);
        sum = _mm256_add_epi32(sum, q);
        if (i == 1) first = sum;  /* the first 16 codes' */
        const __m256i h = _mm256_srai_epi32(_mm256_add_epi32(q, half), 8);
        const __m256i l = _mm256_sub_epi32(q, _mm256_slli_epi32(h, 8));
        _mm_storeu_si128((__m128i *)(a->hl + 2 * (o + 8 * i)), pack_hl(h, l));
        const __m256i q16 = _mm256_packs_epi32(q, q);  /* per lane: q0-3 q0-3 | q4-7 q4-7 */
        _mm_storeu_si128((__m128i *)(a->q + o + 8 * i), _mm256_castsi256_si128(_mm256_permute4x64_epi64(q16, 0x08)));
    }
    const int32_t S = hsum_epi32(sum), S0 = hsum_epi32(first);
    const float s = amax / 32512.0f;
    a->blk[m * a->nb + b] = (lowbit_qblock){s, s * (float)S, 8 * S, 128 * S, 16 * S, 32 * S0, 32 * (S - S0), 0};
}

static void quantize_row(const float *x, const lowbit_qact *a, int64_t m) {
    for (int64_t b = 0; b < a->nb; b++) lowbit_quantize_block(x + b * LOWBIT_BLOCK, a, m, b);
}

/* x [M, K] (rows sx floats apart) → a (sized for M x K). A team function: rows are shared out. */
void lowbit_quantize_rows(const float *x, int64_t sx, lowbit_qact *a) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < a->M; m++) quantize_row(x + m * sx, a, m);
}

/* ---- the matmul ---- */

/* One layout's check (a segment of a chain, or the whole weight). */
static int check_one(const lowbit_linear *w) {
    if (w->kind == 4) return lowbit_kq_check(w);  /* cpu_kq.c */
    if (!w->data || w->N % LOWBIT_TILE || w->group < LOWBIT_BLOCK || w->group % LOWBIT_BLOCK || w->K % w->group)
        return -1;
    if (w->kind == 1) return w->P == 1 || w->P == 2 ? 0 : -1;
    if (w->kind == 2) return w->P == 2 || w->P == 4 ? 0 : -1;
    return -1;
}

int lowbit_linear_check(const lowbit_linear *w, int64_t isa) {
    if (!lowbit_isa_available(isa)) return -1;
    if (w->kind == 3) return w->next ? -1 : lowbit_ggml_check(w);  /* cpu_ggml.c */
    int64_t segments = 0;
    for (const lowbit_linear *s = w; s; s = s->next)
        if (++segments > 4 || s->kind == 3 || s->K != w->K || check_one(s)) return -1;
    return 0;
}

int64_t lowbit_linear_rows(const lowbit_linear *w) {
    int64_t n = 0;
    for (const lowbit_linear *s = w; s; s = s->next) n += s->N;
    return n;
}

/* Tiles [t0, t1) of one layout (its N: y's row length) for rows m0..m0+mc, in the instruction set's kernels. */
static void tiles(int64_t isa, const lowbit_linear *w, const lowbit_qact *a, int64_t m0, int64_t mc, int64_t t0,
                  int64_t t1, float *y) {
    switch (isa * 4 + w->kind - 1) {
#if LB_HAVE_AVX512
        case 4 * LOWBIT_ISA_AVX512: lowbit_int4_tiles_avx512(w, a, m0, mc, t0, t1, y); return;
        case 4 * LOWBIT_ISA_AVX512 + 1: lowbit_int8_tiles_avx512(w, a, m0, mc, t0, t1, y); return;
        case 4 * LOWBIT_ISA_AVX512 + 3: lowbit_kq_tiles_avx512(w, a, m0, mc, t0, t1, y); return;
#endif
#if LB_HAVE_VNNI256
        case 4 * LOWBIT_ISA_VNNI256: lowbit_int4_tiles_vnni256(w, a, m0, mc, t0, t1, y); return;
        case 4 * LOWBIT_ISA_VNNI256 + 1: lowbit_int8_tiles_vnni256(w, a, m0, mc, t0, t1, y); return;
        case 4 * LOWBIT_ISA_VNNI256 + 3: lowbit_kq_tiles_vnni256(w, a, m0, mc, t0, t1, y); return;
#endif
        case 4 * LOWBIT_ISA_AVX2 + 1: lowbit_int8_tiles_avx2(w, a, m0, mc, t0, t1, y); return;
        case 4 * LOWBIT_ISA_AVX2 + 3: lowbit_kq_tiles_avx2(w, a, m0, mc, t0, t1, y); return;
        default: lowbit_int4_tiles_avx2(w, a, m0, mc, t0, t1, y); return;
    }
}

/* Rows per block of a call's activation rows: every tile of the thread's range passes over a block
 * (its weight read from memory once per block), whose codes (2 K bytes a row) should stay near: ~256 KB
 * for small K, and at least 64 rows, since below that re-reading the weight costs more than codes read
 * from L3 (8B shapes, 512 rows, 2 threads, AMD EPYC Zen 4: 4096x14336 Q4_K 126 G multiply-adds/s with
 * 16-row blocks, 145 with 64; 28672x4096 128 with 16, 156-158 with 32-64). */
static int64_t row_block(int64_t K) {
    const int64_t rb = (256 << 10) / (2 * K);
    return rb < 64 ? 64 : rb;
}

/* y [M, N] = a @ W^T (+ bias), a already quantized, N all the chain's rows. A team function: thread i
 * of n takes the chain's tiles [T i / n, T (i + 1) / n), all rows (a block of them at a time), then
 * adds the bias to what it wrote. A row's result does not depend on the blocks: each is the same
 * per-row arithmetic. */
void lowbit_linear_team(const lowbit_ctx *c, const lowbit_linear *w, const lowbit_qact *a, float *y) {
    if (w->kind == 3) {  /* GGML blocks: split by rows (cpu_ggml.c), AVX2 whatever c->isa says */
        lowbit_ggml_team(w, a, y);
        return;
    }
    const int64_t T = lowbit_linear_rows(w) / LOWBIT_TILE, n = omp_get_num_threads(), i = omp_get_thread_num();
    lowbit_linear_tiles(c, w, a, T * i / n, T * (i + 1) / n, y);
#pragma omp barrier
}

/* The chain's tiles [t0, t1) of y = a @ W^T (+ bias) for all of a's rows, on the calling thread alone (no
 * barrier; kinds 1, 2, 4): lowbit_linear_team's share of one thread, and cpu_moe.c's shares of several
 * experts' tiles at once. */
void lowbit_linear_tiles(const lowbit_ctx *c, const lowbit_linear *w, const lowbit_qact *a, int64_t t0, int64_t t1,
                         float *y) {
    const int64_t ldy = lowbit_linear_rows(w), rb = row_block(w->K);
    for (int64_t m0 = 0; m0 < a->M && t1 > t0; m0 += rb) {
        const int64_t mc = a->M - m0 < rb ? a->M - m0 : rb;
        int64_t first = 0;  /* the segment's first tile in the chain */
        for (const lowbit_linear *s = w; s; first += s->N / LOWBIT_TILE, s = s->next) {
            const int64_t s0 = t0 > first ? t0 - first : 0, s1 = t1 - first < s->N / LOWBIT_TILE ? t1 - first : s->N / LOWBIT_TILE;
            if (s1 <= s0) continue;
            lowbit_linear seg = *s;
            seg.N = ldy;  /* y's row length, which the kernels index rows by */
            tiles(c->isa, &seg, a, m0, mc, s0, s1, y + first * LOWBIT_TILE);
        }
    }
    if (t1 > t0 && w->bias)
        for (int64_t m = 0; m < a->M; m++)
            for (int64_t r = t0 * LOWBIT_TILE; r < t1 * LOWBIT_TILE; r++) y[m * ldy + r] += w->bias[r];
}

/* One matmul in its own parallel region: x fp32 [M, K] (rows contiguous) → y fp32 [M, N]. Returns 0,
 * -1 for a layout or instruction set it does not take, -2 for a failed allocation. */
int lowbit_linear_mm(const lowbit_ctx *c, const lowbit_linear *w, const float *x, int64_t M, float *y) {
    if (M < 1 || lowbit_linear_check(w, c->isa)) return -1;
    void *mem = malloc(lowbit_qact_bytes(M, w->K));
    if (!mem) return -2;
    lowbit_qact a;
    lowbit_qact_init(&a, mem, M, w->K);
#pragma omp parallel num_threads((int)c->nthreads)
    {
        lowbit_quantize_rows(x, w->K, &a);
        lowbit_linear_team(c, w, &a, y);
    }
    free(mem);
    return 0;
}

/* ---- the exact path's tiles ---- */

/* 16 rows x 4 bytes (row-major, 64 B) → for each i of 4, the 16 rows' byte i (transposed). */
static inline void transpose16x4(const uint8_t *p, __m128i col[4]) {
    const __m128i by_i = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m128i r[4];
    for (int k = 0; k < 4; k++) r[k] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * k)), by_i);
    const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpacklo_epi32(r[2], r[3]);
    const __m128i t2 = _mm_unpackhi_epi32(r[0], r[1]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
    col[0] = _mm_unpacklo_epi64(t0, t1), col[1] = _mm_unpackhi_epi64(t0, t1);
    col[2] = _mm_unpacklo_epi64(t2, t3), col[3] = _mm_unpackhi_epi64(t2, t3);
}

/* int4 (kind 1), output rows n0..n1-1 (whole tiles) → their W^T fp32 [K, n1 - n0]: w = u * d + m
 * (P = 2) or (u - 8) * d (P = 1), as the torch spec (kernels/int4_mm.py dequantize_packed_t). Groups
 * are shared out over the threads; each writes its groups' rows k of the output. */
int lowbit_int4_dequant_t(const lowbit_linear *w, int64_t n0, int64_t n1, float *out, int nthreads) {
    if (w->kind != 1 || lowbit_linear_check(w, LOWBIT_ISA_AVX2) || n0 < 0 || n1 > w->N || n0 > n1 ||
        n0 % LOWBIT_TILE || n1 % LOWBIT_TILE)
        return -1;
    const int64_t N = n1 - n0, K = w->K, gs = w->group, P = w->P, G = K / gs, tb = lowbit_tile_bytes(w);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t g = 0; g < G; g++) {
        const __m128i low4 = _mm_set1_epi8(15);
        const __m256i eight = _mm256_set1_epi32(8);
        for (int64_t t = n0 / LOWBIT_TILE; t < n1 / LOWBIT_TILE; t++) {
            const uint8_t *unit = lowbit_group_scales(w, w->data + t * tb, g), *codes = lowbit_group_codes(w, w->data + t * tb, g);
            __m256 d[2], m[2];
            for (int hf = 0; hf < 2; hf++) {
                d[hf] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 16 * hf)));
                m[hf] = P == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 32 + 16 * hf))) : d[hf];
            }
            for (int64_t c = 0; c < gs / 8; c++) {  /* chunks of 64 B: k = 8c + i (low), 8c + 4 + i (high) */
                __m128i col[4];
                transpose16x4(codes + 64 * c, col);
                for (int i = 0; i < 4; i++)
                    for (int nib = 0; nib < 2; nib++) {
                        const __m128i u8 = nib ? _mm_and_si128(_mm_srli_epi16(col[i], 4), low4) : _mm_and_si128(col[i], low4);
                        float *o = out + (g * gs + 8 * c + 4 * nib + i) * N + t * LOWBIT_TILE - n0;
                        for (int hf = 0; hf < 2; hf++) {
                            const __m256i u = _mm256_cvtepu8_epi32(hf ? _mm_srli_si128(u8, 8) : u8);
                            const __m256 v = P == 2 ? _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(u), d[hf]), m[hf])
                                                    : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, eight)), d[hf]);
                            _mm256_storeu_ps(o + 8 * hf, v);
                        }
                    }
            }
        }
    }
    return 0;
}

/* Row r of a tile's int8 group g → fp32 o[0..group): w = (u - 128) * d (= q * d, as the spec). */
static inline void int8_group_row(const lowbit_linear *w, const uint8_t *tile, int64_t g, int64_t r, float *o) {
    const uint8_t *unit = lowbit_group_scales(w, tile, g), *codes = lowbit_group_codes(w, tile, g);
    float dr;
    if (w->P == 2) {
        uint16_t h;
        memcpy(&h, unit + 2 * r, 2);
        dr = _cvtsh_ss(h);
    } else {
        memcpy(&dr, unit + 4 * r, 4);
    }
    const __m128 d = _mm_set1_ps(dr);
    const __m128i off = _mm_set1_epi32(128);
    for (int64_t c = 0; c < w->group / 4; c++) {  /* chunk c of 64 B: k = 4c .. 4c + 3 */
        int32_t quad;
        memcpy(&quad, codes + 64 * c + 4 * r, 4);
        const __m128i u = _mm_sub_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(quad)), off);
        _mm_storeu_ps(o + 4 * c, _mm_mul_ps(_mm_cvtepi32_ps(u), d));
    }
}

/* int8 (kind 2) → rows n0..n1-1 of W, fp32 [n1 - n0, K] row-major. Tiles are shared out over the
 * threads. */
int lowbit_int8_dequant(const lowbit_linear *w, int64_t n0, int64_t n1, float *out, int nthreads) {
    if (w->kind != 2 || lowbit_linear_check(w, LOWBIT_ISA_AVX2) || n0 < 0 || n1 > w->N || n0 > n1) return -1;
    const int64_t K = w->K, gs = w->group, G = K / gs, tb = lowbit_tile_bytes(w);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = n0 / LOWBIT_TILE; t < (n1 + LOWBIT_TILE - 1) / LOWBIT_TILE; t++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t r = 0; r < LOWBIT_TILE; r++) {
                const int64_t n = t * LOWBIT_TILE + r;
                if (n < n0) continue;
                if (n >= n1) break;
                int8_group_row(w, w->data + t * tb, g, r, out + (n - n0) * K + g * gs);
            }
    return 0;
}

/* int8 (kind 2) → the rows ids[0..n) of W, fp32 [n, K] (the embedding lookup of a tied table): the
 * same products as lowbit_int8_dequant. Serial: a decode step looks up one row per sequence. */
int lowbit_int8_rows(const lowbit_linear *w, const int64_t *ids, int64_t n, float *out) {
    if (w->kind != 2 || lowbit_linear_check(w, LOWBIT_ISA_AVX2)) return -1;
    const int64_t K = w->K, gs = w->group, G = K / gs, tb = lowbit_tile_bytes(w);
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= w->N) return -1;
        const int64_t t = ids[i] / LOWBIT_TILE, r = ids[i] % LOWBIT_TILE;
        for (int64_t g = 0; g < G; g++) int8_group_row(w, w->data + t * tb, g, r, out + i * K + g * gs);
    }
    return 0;
}
