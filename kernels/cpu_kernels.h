/* The C kernels' shared descriptors, the functions one file calls in another, and every function
 * the library exports (cpu_wq_mm.c, cpu_wq_tiles.c, cpu_block.c, cpu_attention.c, cpu_moe.c, cpu_router.c
 * and the rest of kernels/cpu_native.py's SOURCES are built into one
 * library by kernels/cpu_native.py, which binds the exports and mirrors the structs with ctypes).
 * Each file includes this one and the build has -Werror=missing-prototypes, so a non-static
 * function without its prototype here fails to build and every definition is checked against it. */
#ifndef LOWBIT_CPU_KERNELS_H
#define LOWBIT_CPU_KERNELS_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* The ABI kernels/cpu_native.py binds, checked when it loads the library: this version against its
 * own ABI_VERSION (bump both when an export's signature or meaning changes: ctypes cannot see a
 * prototype), and the sizeof and each field's offset and size of every struct it mirrors against
 * lowbit_abi_layout (cpu_wq_mm.c), so a change on one side only refuses the library instead of
 * corrupting memory. */
#define LOWBIT_ABI_VERSION 8

int lowbit_abi_version(void);  /* LOWBIT_ABI_VERSION */
/* The layout of the structs cpu_native.py mirrors, one entry per struct ("lowbit_block": offset 0,
 * its sizeof) and per field ("lowbit_block.eps": offsetof, sizeof): writes the first `cap` entries
 * (names: static strings) and returns how many there are. */
int64_t lowbit_abi_layout(const char **names, int64_t *offsets, int64_t *sizes, int64_t cap);

/* Instruction sets a matmul can run on (cpu_wq_tiles.c is compiled once per set the CPU has). Every
 * one gives the same bits: the block sums are exact integers and the fp32 epilogue is one source. */
enum { LOWBIT_ISA_AVX2 = 1, LOWBIT_ISA_VNNI256 = 2, LOWBIT_ISA_AVX512 = 3, LOWBIT_ISA_MAX = 3 };

#define LOWBIT_TILE 16   /* output rows per tile of the packed layouts */
#define LOWBIT_BLOCK 32  /* activation values per scale, and k per block of a tile's codes */

/* One weight in lowbit's CPU layout (kernels/int4_mm.py, int8_mm.py, kq_mm.py write it, kernels/tile_layout.py
 * says where each group's bytes are): tiles of 16 output rows, tiles contiguous; per group of gs k,
 * the 16 rows' scales, then the group's gs / 32 blocks of codes, each block in VNNI quad order — 4
 * consecutive k of one row adjacent, 16 rows per 64 bytes:
 *   int4 (kind 1): scales d fp16 [16], m fp16 [16] if P = 2 (w = d u + m; P = 1: w = d (u - 8)),
 *                  codes per block 4 x 64 B, byte [j][r][i] = u[r][8j + i] | u[r][8j + 4 + i] << 4
 *   int8 (kind 2): scales d fp16 [16] (P = 2 bytes) or fp32 [16] (P = 4, per channel: one group of
 *                  K), codes per block 8 x 64 B, byte [j][r][i] = q[r][4j + i] + 128 (w = d q)
 *   GGML blocks in tiles (kind 4, cpu_kq_tiles.c; P the GGML type, group its super-block: 256 for
 *                  Q4_K, Q5_K, Q6_K, 32 for Q5_0, Q5_1, two blocks (64) for MXFP4): the header of the
 *                  group's 16 rows (kq_mm.py says what each type's holds: fp16 super-scales, integer
 *                  sub-block scales, MXFP4's E8M0 exponent bytes), then per
 *                  block int4's 4 x 64 B of low nibbles and the codes' high bits: 64 B (5-bit codes,
 *                  bit 2j + h of byte [r][i] is bit 4 of the code in nibble h of byte [j][r][i]) or
 *                  2 x 64 B (6-bit: bits 2v, 2v + 1 of byte [r][i] of the first for nibble vectors
 *                  v = 2j + h < 4, of the second for v - 4); MXFP4's nibbles index its codebook, no
 *                  high bits
 * Units start on 64-byte lines: 64 bytes of scales (one group's, or two groups' when theirs take 32),
 * or a kind-4 header of 256 or 320 bytes, then those groups' codes.
 *   GGML blocks (kind 3, cpu_ggml.c): rows as GGUF stores them, each row K / QK blocks of its type (P, a
 *                  GGML type number; kernels/ggml_blocks.py), any N; rows from `split` on are of type
 *                  P2 at data2 (a fused QKV whose V rows have another type), else split = N.
 * A tile-kind weight may go on in `next`: its rows N.. in a layout of their own (a fused QKV whose V
 * rows have another type), so one call writes y [M, N + next->N + ...]. */
typedef struct lowbit_linear {
    int64_t kind;   /* 1: int4, 2: int8, 3: GGML blocks, 4: GGML blocks in tiles */
    int64_t N;      /* output rows held; kinds 1, 2, 4: a multiple of 16 (padding rows are zero weights) */
    int64_t K;      /* input features, a whole number of groups (x is padded to it) */
    int64_t group;  /* k per group: 32, 64, 128 (int8 per channel: K; kinds 3, 4: values per block) */
    int64_t P;      /* int4: scales per row and group (1 or 2); int8: bytes per scale (2 or 4); kinds 3, 4: type */
    const uint8_t *data;
    const float *bias;  /* fp32 [N + rows of next...] or NULL */
    int64_t split, P2;  /* kind 3: rows of type P, the type of the rest */
    const uint8_t *data2;
    const struct lowbit_linear *next;  /* kinds 1, 2, 4: the rows after these, or NULL */
} lowbit_linear;

enum { LOWBIT_Q5_0 = 6, LOWBIT_Q5_1 = 7, LOWBIT_Q4_K = 12, LOWBIT_Q5_K = 13, LOWBIT_Q6_K = 14, LOWBIT_MXFP4 = 39 };

/* Kind 4: a group's header bytes (16 rows) and a 32-k block's code bytes, by GGML type (0: not one). */
static inline int64_t lowbit_kq_header(int64_t t) {
    return t == LOWBIT_Q4_K || t == LOWBIT_Q5_K ? 256 : t == LOWBIT_Q6_K ? 320
         : t == LOWBIT_Q5_0 || t == LOWBIT_MXFP4 ? 32 : t == LOWBIT_Q5_1 ? 64 : 0;
}
static inline int64_t lowbit_kq_block(int64_t t) {
    return t == LOWBIT_Q4_K || t == LOWBIT_MXFP4 ? 256 : t == LOWBIT_Q6_K ? 384 : 320;
}

/* MXFP4's E8M0 exponent byte e → its scale 2^(e - 128) in fp32 (half of E8M0's 2^(e - 127): the codebook
 * holds E2M1's values doubled, kernels/ggml_blocks.py), from its bits as ggml's ggml_e8m0_to_fp32_half:
 * e >= 2 the normal (e - 1) << 23, e = 1 and 0 the subnormals 2^-127 and 2^-128. */
static inline float lowbit_e8m0_half(uint8_t e) {
    const union { uint32_t u; float f; } v = {e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23};
    return v.f;
}

/* Bytes of one group's 16 scales (a kind-4 header), of its codes, and log2 of the groups per unit
 * (kernels/tile_layout.py: one, or two when their scales take 32 bytes). Shifts, not divisions: these
 * run per group per pass. */
static inline int64_t lowbit_scale_bytes(const lowbit_linear *w) {
    return w->kind == 1 ? 32 * w->P : w->kind == 2 ? 16 * w->P : lowbit_kq_header(w->P);
}
static inline int64_t lowbit_code_bytes(const lowbit_linear *w) {
    return w->kind == 1 ? 8 * w->group : w->kind == 2 ? 16 * w->group : w->group / 32 * lowbit_kq_block(w->P);
}
static inline int64_t lowbit_pair_shift(const lowbit_linear *w) { return lowbit_scale_bytes(w) == 32; }
/* The bytes a unit's scales take: 64 (one or two groups'), or a kind-4 header of more. */
static inline int64_t lowbit_unit_head(const lowbit_linear *w) {
    const int64_t sb = lowbit_scale_bytes(w);
    return sb <= 64 ? 64 : sb;
}

static inline int64_t lowbit_tile_bytes(const lowbit_linear *w) {
    const int64_t G = w->K / w->group, s = lowbit_pair_shift(w), cb = lowbit_code_bytes(w), A = lowbit_unit_head(w);
    return (G >> s) * (A + (cb << s)) + (G & s) * (A + cb);
}

/* Group gi of a tile: its scales and codes. */
static inline const uint8_t *lowbit_group_scales(const lowbit_linear *w, const uint8_t *tile, int64_t gi) {
    const int64_t s = lowbit_pair_shift(w);
    return tile + (gi >> s) * (lowbit_unit_head(w) + (lowbit_code_bytes(w) << s)) + (gi & s) * 32;
}

static inline const uint8_t *lowbit_group_codes(const lowbit_linear *w, const uint8_t *tile, int64_t gi) {
    const int64_t s = lowbit_pair_shift(w), cb = lowbit_code_bytes(w), A = lowbit_unit_head(w);
    return tile + (gi >> s) * (A + (cb << s)) + A + (gi & s) * cb;
}

/* The groups of a tile in order, as the kernels walk them: the same addresses as lowbit_group_scales
 * and lowbit_group_codes without their multiplies (a unit's start moves on after its last group). */
typedef struct {
    const uint8_t *unit;  /* the unit holding the current group */
    int64_t ps, cb, A;    /* lowbit_pair_shift, lowbit_code_bytes, lowbit_unit_head */
} lowbit_group_walk;

static inline lowbit_group_walk lowbit_walk(const lowbit_linear *w, const uint8_t *tile) {
    return (lowbit_group_walk){tile, lowbit_pair_shift(w), lowbit_code_bytes(w), lowbit_unit_head(w)};
}
static inline const uint8_t *lowbit_walk_scales(const lowbit_group_walk *k, int64_t gi) {
    return k->unit + (gi & k->ps) * 32;
}
static inline const uint8_t *lowbit_walk_codes(const lowbit_group_walk *k, int64_t gi) {
    return k->unit + k->A + (gi & k->ps) * k->cb;
}
static inline void lowbit_walk_next(lowbit_group_walk *k, int64_t gi) {  /* after group gi */
    k->unit += (gi & k->ps) == k->ps ? k->A + (k->cb << k->ps) : 0;
}

/* Activations as the integer kernels read them (kernels/act_quant.py is the spec): per row, per
 * block of 32, s = amax / 32512 and q = round(x * 32512 / amax), split into planes q = 256 h + l. */
typedef struct {
    float s;    /* the block's scale */
    float sS;   /* s * (float)S: the int4 min term's factor */
    int32_t S8;    /* 8 S, S the sum of the block's codes: the term of symmetric int4's u - 8 */
    int32_t S128;  /* 128 S: the term of int8's stored q + 128 */
    int32_t S16;   /* 16 S: Q5_0's u - 16 */
    int32_t S32a, S32b;  /* 32 x the sums of the first and the last 16 codes: Q6_K's u - 32 per half */
    int32_t pad;
} lowbit_qblock;

typedef struct {
    int64_t M, K, nb;   /* rows, columns (a multiple of 32), blocks per row (K / 32) */
    int8_t *hl;         /* [M, 2K]: per 4 k, their 4 h in [-127, 127] then their 4 l in [-128, 127] */
    int16_t *q;         /* [M, K]: the codes (AVX2's int8 kernel multiplies them with vpmaddwd) */
    lowbit_qblock *blk; /* [M, nb] */
} lowbit_qact;

/* How a call runs: the instruction set of its matmuls, the threads of its parallel region. */
typedef struct {
    int64_t isa, nthreads;
} lowbit_ctx;

/* The shapes of one block; the weights are the lowbit_linear descriptors. */
typedef struct {
    int64_t dim, n_heads, n_kv_heads, head_dim, hidden;
    float eps;
    const float *attn_norm, *ffn_norm;  /* fp32 [dim] */
    lowbit_linear qkv, o, gate_up, down;  /* qkv: [(H + 2 Hkv) D, dim]; gate_up: [2 hidden, dim] */
    const float *q_norm, *k_norm;  /* fp32 [head_dim]: RMSNorm over each head before rotary (Qwen3), or NULL */
    /* Gemma: RMSNorms of the attention output and of the MLP output before each residual add, or NULL */
    const float *attn_post_norm, *ffn_post_norm;
    int64_t act;     /* the gated MLP's activation: 0 SiLU (SwiGLU), 1 GELU, tanh approximation (GeGLU) */
    int64_t rope;    /* lowbit_decode_paged_layers: which of its rotary tables this block's layer takes */
    int64_t window;  /* lowbit_decode_paged_layers: this layer's sliding window, 0 for none */
    /* lowbit_decode_paged_layers: this layer's attention sinks, fp32 [n_heads] (gpt-oss: one learned logit per
     * head in each row's softmax, with no value), or NULL */
    const float *sinks;
    /* a mixture of experts in place of gate_up, act and down (cpu_moe.c: router and experts), or NULL */
    const struct lowbit_moe *moe;
} lowbit_block;

/* One side (K or V) of one layer of the paged pool (runtime/engine/kv_cache.py), as stored (codes points at
 * a float side's data): bits 32: fp32 data [P, Hkv, page, D]; 16: fp16 data [P, Hkv, page, D]; 8: int8
 * codes [P, Hkv, page, D], fp16 scales [P, Hkv, page, D/group] (x = d q); 4: uint8 codes
 * [P, Hkv, page, D/2] (low nibble first), fp16 scales and mins [P, Hkv, page, D/group] (x = d u + m). */
typedef struct {
    int64_t bits, group;
    void *codes;
    uint16_t *scales, *mins;
} lowbit_kv_side;

/* cpu_wq_mm.c: whether the CPU runs the library (AVX2 + FMA), which instruction sets it has. */
int lowbit_native_ok(void);
int lowbit_isa_available(int64_t isa);
int64_t lowbit_isa_best(void);

/* cpu_wq_mm.c: activation quantization and the matmul, as parts of a parallel region ("team": every
 * thread of the region calls it; it shares the work out and ends in a barrier) or standalone. */
size_t lowbit_qact_bytes(int64_t M, int64_t K);
void lowbit_qact_init(lowbit_qact *a, void *mem, int64_t M, int64_t K);
void lowbit_quantize_block(const float *xb, const lowbit_qact *a, int64_t m, int64_t b);
void lowbit_quantize_rows(const float *x, int64_t sx, lowbit_qact *a);
int lowbit_linear_check(const lowbit_linear *w, int64_t isa);
int64_t lowbit_linear_rows(const lowbit_linear *w);  /* output rows of the weight and its `next`s */
void lowbit_linear_team(const lowbit_ctx *c, const lowbit_linear *w, const lowbit_qact *a, float *y);
void lowbit_linear_tiles(const lowbit_ctx *c, const lowbit_linear *w, const lowbit_qact *a, int64_t t0, int64_t t1,
                         float *y);  /* one thread's tiles [t0, t1) of the chain, no barrier; kinds 1, 2, 4 */
int lowbit_linear_mm(const lowbit_ctx *c, const lowbit_linear *w, const float *x, int64_t M, float *y);

/* cpu_wq_mm.c: the exact path's dequantized weight tiles and the int8 embedding lookup. */
int lowbit_int4_dequant_t(const lowbit_linear *w, int64_t n0, int64_t n1, float *out, int nthreads);
int lowbit_int8_dequant(const lowbit_linear *w, int64_t n0, int64_t n1, float *out, int nthreads);
int lowbit_int8_rows(const lowbit_linear *w, const int64_t *ids, int64_t n, float *out);

/* cpu_kq.c: kind-4 weights (GGML blocks in tiles): the check, the repack at load (of Q4_0, Q4_1, Q8_0 into
 * kinds 1, 2 too), exact fp32 rows. */
int lowbit_kq_check(const lowbit_linear *w);
int lowbit_tiles_pack(int64_t t, const uint8_t *src, int fd, int64_t offset, const int64_t *perm, int64_t N,
                      int64_t K, uint8_t *dst, int nthreads);
int lowbit_kq_rows(const lowbit_linear *w, const int64_t *ids, int64_t n, float *out);
int lowbit_kq_dequant(const lowbit_linear *w, int64_t n0, int64_t n1, float *out, int nthreads);

/* cpu_ggml.c: kind-3 weights (GGML blocks): the check, the matmul as a team function, exact fp32 rows. */
int lowbit_ggml_check(const lowbit_linear *w);
void lowbit_ggml_team(const lowbit_linear *w, const lowbit_qact *a, float *y);
int lowbit_ggml_dequant(const lowbit_linear *w, int64_t n0, int64_t n1, float *out, int nthreads);

/* cpu_wq_tiles.c and cpu_kq_tiles.c, one set per instruction set: output tiles [t0, t1) of y for rows
 * m0..m0+mc, y's rows w->N floats apart. */
#define LOWBIT_TILES(isa)                                                                                 \
    void lowbit_int4_tiles_##isa(const lowbit_linear *w, const lowbit_qact *a, int64_t m0, int64_t mc,   \
                                 int64_t t0, int64_t t1, float *y);                                       \
    void lowbit_int8_tiles_##isa(const lowbit_linear *w, const lowbit_qact *a, int64_t m0, int64_t mc,   \
                                 int64_t t0, int64_t t1, float *y);                                       \
    void lowbit_kq_tiles_##isa(const lowbit_linear *w, const lowbit_qact *a, int64_t m0, int64_t mc,     \
                               int64_t t0, int64_t t1, float *y);
LOWBIT_TILES(avx2)
LOWBIT_TILES(vnni256)
LOWBIT_TILES(avx512)

/* exp(x) for 8 lanes (cpu_attention.c's softmax, cpu_block.c's SiLU): x = n ln2 + r (|r| <= ln2 / 2,
 * ln2 in two parts), exp(r) by its degree-6 Taylor polynomial (relative error < 3e-8 there), times
 * 2^n through the exponent bits; +inf above 88.72 as expf, exp(-87.3) (the smallest normal float's
 * neighbourhood) below -87.3. libm's scalar expf was ~15% of paged attention's time at 256 tokens
 * of context and 4% of a 512-token prefill (SiLU). */
static inline __m256 exp8(__m256 x) {
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.0f / 720.0f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(__builtin_inff()), over);
}

/* cpu_block.c and cpu_attention.c: the small per-row ops, attention, quantize-on-write (each file
 * calls some of the other's). */
void lowbit_add_rms_norm(const float *x, int64_t sx, float *res, int has_res, const float *w, float eps,
                         int64_t M, int64_t D, float *out);
void lowbit_rotary(float *x, int64_t M, int64_t H, int64_t sm, int64_t sh, int64_t D, const float *cos,
                   const float *sin);
void lowbit_silu_mul(const float *gate, int64_t sg, const float *up, int64_t su, int64_t M, int64_t I, float *out);
void lowbit_gelu_tanh_mul(const float *gate, int64_t sg, const float *up, int64_t su, int64_t M, int64_t I,
                          float *out);
/* one row's act(g) * u over n values (gelu: 0 SiLU, 1 GELU tanh), the loop lowbit_silu_mul runs per row */
void lowbit_gated_mul_n(const float *g, const float *u, int64_t n, float *out, int gelu);
int lowbit_kv_write(const float *x, int64_t sx, int64_t M, int64_t Hkv, int64_t D, const int64_t *slots,
                    int64_t page_size, const lowbit_kv_side *s, const float *rot);
int lowbit_kv_write_team(const float *kx, const float *vx, int64_t sx, int64_t M, int64_t Hkv, int64_t D,
                         const int64_t *slots, int64_t page_size, const lowbit_kv_side *ks, const lowbit_kv_side *vs,
                         const float *rot);
int64_t lowbit_paged_attention_plan(int64_t R, const int64_t *ctx, int64_t window, int64_t *plan);
size_t lowbit_paged_attention_scratch(int64_t H, int64_t Hkv, int64_t D);
size_t lowbit_paged_attention_partials(int64_t nchunks, int64_t H, int64_t D);
void lowbit_paged_attention_team(const float *q, int64_t sq, int64_t R, int64_t H, int64_t Hkv, int64_t D,
                                 const int64_t *plan, int64_t nchunks, const int64_t *tables, const int64_t *toff,
                                 int64_t page_size, const lowbit_kv_side *ks, const lowbit_kv_side *vs,
                                 const float *rot, const float *sinks, float scale, float *scratch, size_t per_thread,
                                 float *partials, float *out);
int lowbit_paged_decode_attention(const float *q, int64_t sq, int64_t R, int64_t H, int64_t Hkv, int64_t D,
                                  const int64_t *ctx, const int64_t *tables, const int64_t *toff, int64_t page_size,
                                  const lowbit_kv_side *ks, const lowbit_kv_side *vs, const float *rot,
                                  const float *sinks, int64_t window, float scale, float *out, int nthreads);

/* cpu_block.c: a block's fused halves, and a whole decode step over the paged pool. */
int lowbit_block_pre(const lowbit_ctx *c, const lowbit_block *b, int64_t M, const float *delta, float *residual,
                     int has_res, const float *cos, const float *sin, float *qkv);
int lowbit_block_post(const lowbit_ctx *c, const lowbit_block *b, int64_t M, const float *attn, float *residual,
                      float *delta);
int lowbit_decode_paged_layers(const lowbit_ctx *c, const lowbit_block *blocks, int64_t L, int64_t M, float *delta,
                               float *residual, const float *cos, const float *sin, int64_t n_tables,
                               const int64_t *slots, int64_t page_size, const lowbit_kv_side *k_sides,
                               const lowbit_kv_side *v_sides, const float *write_rot, const float *attn_rot,
                               const int64_t *ctx, const int64_t *tables, const int64_t *toff, float scale);

/* cpu_moe.c: a mixture of experts' experts (kernels/cpu_moe.py): per expert e its fused gate+up
 * gate_up[e] [2 hidden, dim] (gate rows first) and down[e] [dim, hidden], each with its bias or none. */
typedef struct lowbit_moe {
    int64_t n_experts, dim, hidden;
    int64_t act;          /* 0: SiLU(gate) * up (Qwen3-MoE); 2: gpt-oss's clamped SwiGLU (alpha, limit) */
    float alpha, limit;
    const lowbit_linear *gate_up, *down;  /* [n_experts] each */
    /* the router (cpu_router.c): fp32 [n_experts, dim] and its bias [n_experts] or NULL; k experts a row; rule
     * 0: softmax over all, top k (renormalised when norm_topk), 1: top k logits, softmax over them */
    const float *router, *router_bias;
    int64_t k, rule, norm_topk;
} lowbit_moe;

void lowbit_swiglu_clamped(const float *gate, int64_t sg, const float *up, int64_t su, int64_t M, int64_t I,
                           float *out, float alpha, float limit);
int lowbit_moe_check(const lowbit_ctx *c, const lowbit_moe *m);
size_t lowbit_moe_scratch(const lowbit_moe *m, int64_t M, int64_t k);
int lowbit_moe_experts(const lowbit_ctx *c, const lowbit_moe *m, int64_t M, const float *x, int64_t k,
                       const int64_t *ids, const float *wts, float *out);
/* the whole MoE of M rows as a team function (cpu_block.c's fused block): route, then the experts; mem:
 * lowbit_moe_scratch(m, M, m->k) bytes */
void lowbit_moe_team(const lowbit_ctx *c, const lowbit_moe *m, int64_t M, const float *x, float *out, void *mem);
/* cpu_router.c: the router, standalone (Experts.route) and as team functions */
int lowbit_moe_route(const lowbit_ctx *c, const lowbit_moe *m, int64_t M, const float *x, int64_t *ids, float *w);
void lowbit_route_logits_team(const lowbit_moe *m, int64_t M, const float *x, float *logits);
void lowbit_route_row(const lowbit_moe *m, const float *logits, float *p, int64_t *ids, float *w);
void lowbit_route_team(const lowbit_moe *m, int64_t M, const float *x, float *logits, float *p, int64_t *ids, float *w);

/* cpu_gated_delta.c: Gated DeltaNet's token-by-token step (models/deltanet.py). prep: raw [T, C] (C = 2 Hk Dk +
 * Hv Dv) through the conv over conv [C, K - 1] (updated) and weights [C, K], SiLU, q/k L2-normed (q times
 * Dk^-1/2) → q, k [T, Hv, Dk], v [T, Hv, Dv]; rule: the delta rule over state [H, Dk, Dv] (updated) with g, beta
 * [T, H] → out [T, H, Dv]. Both return 0, or non-zero for unsupported shapes. */
int lowbit_gated_delta_prep(const float *raw, int64_t T, float *conv, const float *conv_w, int64_t K, int64_t Hk,
                            int64_t Hv, int64_t Dk, int64_t Dv, int tiled, float l2_eps, float *q, float *k,
                            float *v);
int lowbit_gated_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta,
                            int64_t T, int64_t H, int64_t Dk, int64_t Dv, float *state, float *out);

#endif
