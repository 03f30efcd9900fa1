/* The C kernels' shared descriptors and the functions one file calls in another (cpu_wq_mm.c,
 * cpu_block.c, cpu_attention.c are built into one library by kernels/cpu_native.py, which mirrors
 * these structs with ctypes). */
#ifndef LOWBIT_CPU_KERNELS_H
#define LOWBIT_CPU_KERNELS_H
#include <stdint.h>

/* One weight as its C kernel reads it (kernels/cpu_native.py fills it from Int4Packed/Int8Packed). */
typedef struct {
    int64_t kind;   /* 1: int4, torch's CPU tile layout; 2: int8, group-major [G, N, g] */
    int64_t N;      /* output features (int4: a multiple of 16, no padding rows) */
    int64_t K;      /* input features (a whole number of groups, no padding columns) */
    int64_t group;  /* int4: group size; int8: g */
    int64_t P;      /* int4: 2 (scale, min) pairs or 1 (scale); int8: 1 if the scales are fp32, 0 if fp16 */
    const void *codes;
    const void *scales;
    const float *bias;  /* fp32 [N] or NULL */
} lowbit_linear;

/* The shapes of one block; the weights are the lowbit_linear descriptors. */
typedef struct {
    int64_t dim, n_heads, n_kv_heads, head_dim, hidden;
    float eps;
    const float *attn_norm, *ffn_norm;  /* fp32 [dim] */
    lowbit_linear qkv, o, gate_up, down;  /* qkv: [(H + 2 Hkv) D, dim]; gate_up: [2 hidden, dim] */
} lowbit_block;

/* One side (K or V) of one layer of the paged pool (runtime/kv_cache.py), as stored: bits 16: fp16
 * data [P, Hkv, page, D]; 8: int8 codes [P, Hkv, page, D], fp16 scales [P, Hkv, page, D/group] (x = d q);
 * 4: uint8 codes [P, Hkv, page, D/2] (low nibble first), fp16 scales and mins [P, Hkv, page, D/group]
 * (x = d u + m). */
typedef struct {
    int64_t bits, group;
    void *codes;
    uint16_t *scales, *mins;
} lowbit_kv_side;

int lowbit_int4_mm(const float *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sm, int64_t P,
                   int64_t Np, int64_t gs, float *xs, float *y, int nthreads);
int lowbit_int8_mm(const float *x, int64_t M, int64_t G, int64_t N, int64_t g, const int8_t *q, const void *scales,
                   int scale_f32, float *y, int nthreads);
int lowbit_block_pre(const lowbit_block *b, int64_t M, const float *delta, float *residual, int has_res,
                     const float *cos, const float *sin, float *qkv, int nthreads);
int lowbit_block_post(const lowbit_block *b, int64_t M, const float *attn, float *residual, float *delta,
                      int nthreads);
int lowbit_decode_attention(const float *q, int64_t sq, const float *k, const float *v, int64_t skv, float *cache_k,
                            float *cache_v, int64_t cb, int64_t ch, int64_t B, int64_t H, int64_t Hkv, int64_t S,
                            int64_t D, const int64_t *pos, int64_t window, float scale, float *out, int nthreads);
int lowbit_kv_write(const float *x, int64_t sx, int64_t M, int64_t Hkv, int64_t D, const int64_t *slots,
                    int64_t page_size, const lowbit_kv_side *s, const float *rot);
int lowbit_paged_decode_attention(const float *q, int64_t sq, int64_t R, int64_t H, int64_t Hkv, int64_t D,
                                  const int64_t *ctx, const int64_t *tables, const int64_t *toff, int64_t page_size,
                                  const lowbit_kv_side *ks, const lowbit_kv_side *vs, const float *rot,
                                  int64_t window, float scale, float *out, int nthreads);

#endif
