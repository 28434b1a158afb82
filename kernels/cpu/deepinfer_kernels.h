/* The native CPU kernels' ABI: every function the library exports and every struct they take.

   Every C file here includes this header (the compiler then checks each definition against
   its prototype, and -Werror=missing-prototypes refuses an exported function declared nowhere
   else). `kernels/native/cpu_abi.py` mirrors it in ctypes, and
   tests/kernels/native/test_cpu_abi.py parses this file to check that mirror: keep to the forms
   its parser reads (`typedef struct { ... } name;` with one field per declaration, prototypes
   ending in `;`, `#define DI_...` integers).

   Every function returns 0 on success, -1 on bad arguments, -2 when out of memory, unless it
   says otherwise. Row strides are in elements. Calls that would take a dozen or more scalars
   take a struct instead (one per call kind), so its fields are named at every call site.
*/
#ifndef DEEPINFER_KERNELS_H
#define DEEPINFER_KERNELS_H

#include <stdint.h>

#define DI_QK 32           /* weights per GGUF block (Q4_1, Q8_0) */
#define DI_QK_K 256        /* weights per GGUF K-quant superblock (Q4_K, Q5_K, Q6_K) */
#define DI_MAX_HEAD_DIM 256 /* the attention kernel's largest head size */
#define DI_MAX_GROUP 16     /* the attention kernel's most query heads per KV head */

/* GGUF block formats, numbered as `quant_matmul.QuantFormat` numbers them (layouts: cpu/blocks.h).
   A matrix's width K is a whole number of its format's blocks. */
#define DI_FMT_Q4_1 0
#define DI_FMT_Q8_0 1
#define DI_FMT_Q4_K 2
#define DI_FMT_Q5_K 3
#define DI_FMT_Q6_K 4

/* Matmuls, y[M, N] = x[M, K] @ W[N, K]^T (cpu/quant_gemm.c, cpu/int8_gemm.c). */
int di_quant_gemm(int fmt, const uint8_t *w, const float *x, float *y, int M, int N, int K,
                  int num_threads);
int di_dequantize(int fmt, const uint8_t *w, float *out, int N, int K, int num_threads);
/* Q5_0 blocks (22 bytes) as the Q8_0 blocks (34 bytes) of the same values, exactly. */
int di_q5_0_to_q8_0(const uint8_t *src, uint8_t *dst, long nblocks, int num_threads);
long di_int8_packed_bytes(int fmt, int N, int K); /* 0 for bad arguments */
int di_int8_pack(int fmt, const uint8_t *w, uint8_t *out, int N, int K, int num_threads);
int di_int8_gemm(int fmt, const uint8_t *packed, const float *x, float *y, int M, int N, int K,
                 int num_threads);
/* A weight in two formats: rows [0, N - N2) in fmt (a multiple of 8 rows), then N2 rows in fmt2,
   each packed by di_int8_pack, end to end (di_int8_split_packed_bytes bytes; 0 for bad
   arguments). N2 == 0 is di_int8_gemm. */
long di_int8_split_packed_bytes(int fmt, int fmt2, int N2, int N, int K);
int di_int8_gemm_split(int fmt, int fmt2, int N2, const uint8_t *packed, const float *x,
                       float *y, int M, int N, int K, int num_threads);
/* di_int8_gemm_split going on from y's values: each output's sum over the blocks of K
   continues y's, so chained slices of K give the bits of one product over all of it. */
int di_int8_gemm_acc(int fmt, int fmt2, int N2, const uint8_t *packed, const float *x, float *y,
                     int M, int N, int K, int num_threads);
/* Rows [row0, row0 + rows) of a weight packed by di_int8_pack as bfloat16, out[rows, K] (row0 a
   multiple of 8): the float32 weights rounded to nearest even (cpu/int8_unpack.c). */
int di_int8_unpack_bf16(int fmt, const uint8_t *packed, int N, int K, int row0, int rows,
                        uint16_t *out, int num_threads);
/* Which instructions di_int8_gemm (and the decoder stack's int8 matmuls) use: 1 for AVX-512
   VNNI, 0 for AVX2. `want` 1 picks VNNI where the CPU has it (the default), 0 AVX2, -1 keeps the
   choice; returns the choice now. Both give the same bits. Not for while a matmul runs. */
int di_int8_isa(int want);
/* Whether the VNNI passes of K-quant weights take two groups of rows at once in 512-bit
   vectors (1, the default) or one in 256-bit ones (0); -1 keeps the choice. Same bits. */
int di_int8_pairs(int want);

/* out[r] = the first index of row r's largest value, -1 where that value is not finite (a NaN in
   the row, +inf, or no value above -inf): the sampler's greedy pick (cpu/sampling.c). */
int di_argmax_rows(const float *x, long stride, int rows, int V, int64_t *out, int threads);

/* out = rms_norm(x (+ residual)) * w; with a residual, summed = x + residual as well. residual
   and summed are NULL for a plain RMSNorm. D a multiple of 8. */
typedef struct {
    const float *x;
    long x_stride;
    const float *residual;
    long residual_stride;
    const float *w;
    float *out;
    long out_stride;
    float *summed;
    long summed_stride;
    int T;
    int D;
    float eps;
    int num_threads;
} di_rms_norm_args;

/* Paged decode attention, one query row per request: q [B, H, D] with strides (q_stride_b,
   q_stride_h, 1); out [B, H, D] contiguous; caches [num_blocks, S, Hkv, D] float32, or float16
   when kv_f16. D a multiple of 16 up to DI_MAX_HEAD_DIM, H / Hkv at most DI_MAX_GROUP. With
   window > 0 (a sliding-window layer) each query attends to its last `window` keys only, and
   no block before the one holding the first of them is read; 0: every key. */
typedef struct {
    const float *q;
    long q_stride_b;
    long q_stride_h;
    const void *k_cache;
    const void *v_cache;
    const int32_t *block_tables;
    int max_blocks;
    const int32_t *context_lens;
    float *out;
    int B;
    int H;
    int Hkv;
    int D;
    int S;
    float scale;
    int num_threads;
    int kv_f16;
    int window;
} di_attention_args;

/* The per-layer ops (cpu/elementwise.c) and attention (cpu/paged_attention.c). */
int di_rms_norm(const di_rms_norm_args *a);
int di_rotary(float *q, long q_stride, int H, float *k, long k_stride, int Hkv,
              const int64_t *positions, const float *cos_sin, long P, int T, int D,
              int num_threads);
int di_store_kv(const float *k, long k_stride, const float *v, long v_stride, void *k_cache,
                void *v_cache, long num_slots, const int64_t *slots, int T, int width,
                int kv_f16);
int di_silu_mul(const float *gu, long gu_stride, float *out, long out_stride, int T, int I,
                int num_threads);
int di_gelu_tanh_mul(const float *gu, long gu_stride, float *out, long out_stride, int T, int I,
                     int num_threads);
int di_paged_decode_attention(const di_attention_args *a);

/* One weight of the decoder stack: GGUF blocks (int8 == 0) or int8-repacked groups (int8 == 1).
   An int8 weight may keep its last N2 rows in another format, fmt2 (di_int8_gemm_split); N2 is
   0 otherwise. */
typedef struct {
    const uint8_t *data;
    int fmt;
    int int8;
    int N;
    int K;
    int fmt2;
    int N2;
} di_matrix;

/* The MLP's gate activation (di_llama_layer.activation): silu(gate) * up (di_silu_mul) or
   gelu_tanh(gate) * up (di_gelu_tanh_mul). */
#define DI_ACT_SILU 0
#define DI_ACT_GELU_TANH 1

/* One decoder layer. input_norm normalizes the layer's input, post_norm the MLP's (each fused
   with the residual add before it). Optional, NULL where the layer has none: q_norm and k_norm
   [head_dim], an RMSNorm of every head of q and k before rotary (Qwen3, Gemma 3);
   attn_out_norm and mlp_out_norm [hidden], an RMSNorm of the attention and MLP outputs before
   they join the residual stream (Gemma 3); qkv_bias, the q/k/v projection's bias (Qwen2). cos_sin: the layer's RoPE table [num_positions,
   head_dim] (di_rotary's); window: its sliding window, 0 for every key (di_attention_args). */
typedef struct {
    di_matrix qkv;
    di_matrix o;
    di_matrix gate_up;
    di_matrix down;
    const float *input_norm;
    const float *post_norm;
    const float *q_norm;
    const float *k_norm;
    const float *attn_out_norm;
    const float *mlp_out_norm;
    const float *cos_sin;
    int window;
    int activation;
    void *k_cache;
    void *v_cache;
    const float *qkv_bias; /* [q + 2 kv rows], added to the q/k/v projection; NULL for none */
} di_llama_layer;

/* What one step of the stack shares across layers. slots [T] (negative: a token whose K/V is
   not stored) index the caches' rows, block_tables [T, max_blocks] their blocks. Where the
   sliding-window layers keep their KV in a paged pool of their own, window_slots,
   window_block_tables and their sizes address that pool for every layer with window > 0 (the
   other layers keep slots and block_tables); NULL window_slots: one pool for all layers.
   positions and context_lens are the same for both pools. */
typedef struct {
    int T;
    int hidden;
    int H;
    int Hkv;
    int head_dim;
    int intermediate;
    float eps;
    float scale;
    const int64_t *positions;
    long num_positions;
    const int64_t *slots;
    long num_slots;
    const int32_t *block_tables;
    int max_blocks;
    const int32_t *context_lens;
    int block_size;
    int kv_f16;
    int num_threads;
    const int64_t *window_slots;
    long window_num_slots;
    const int32_t *window_block_tables;
    int window_max_blocks;
} di_llama_step;

/* The decoder stack in one call (cpu/llama_layers.c). */
int di_llama_layers(const di_llama_layer *layers, int num_layers, const di_llama_step *s,
                    float *h, float *residual, int has_residual);

/* A Mixture-of-Experts layer's experts in one call (cpu/moe_experts.c): x [sum(rows), D] holds
   runs of rows, run r all routed to expert experts[r] and rows[r] long; y gets each row's
   down(silu(gate) * up) of its expert. gate_up [E] are [2I, D] weights (rows gate; up), down [E]
   [D, I]. Returns 0, -1 on bad arguments, -2 when out of memory. */
int di_moe_experts(const di_matrix *gate_up, const di_matrix *down, int E, int num_runs,
                   const int *experts, const int *rows, const float *x, float *y, int D, int I,
                   int num_threads);

/* sizeof each struct, as this compiler lays it out: the ctypes mirror checks itself against
   them (cpu/abi.c). */
long di_sizeof_rms_norm_args(void);
long di_sizeof_attention_args(void);
long di_sizeof_matrix(void);
long di_sizeof_llama_layer(void);
long di_sizeof_llama_step(void);

#endif
