/* The kernels as pieces the one-region decoder stack (cpu/llama_layers.c) calls: argument checks
   (run once, before the region), row-range bodies, and team computations (cpu/team.h) that share
   their work out over the calling team. A team computation syncs the team between its own
   phases but not after its last one: the caller syncs before anything reads what it wrote.
   The library's entry points (deepinfer_kernels.h) are built from the same pieces, so the
   stack's results are the layer-by-layer path's, bit for bit. */
#ifndef DEEPINFER_PARTS_H
#define DEEPINFER_PARTS_H

#include <stdatomic.h>
#include <stdint.h>

#include "deepinfer_kernels.h"
#include "team.h"

/* Shared between the library's files, not exported (the ABI is deepinfer_kernels.h's). */
#define DI_INTERNAL __attribute__((visibility("hidden")))

/* elementwise.c: checks (0 or -1), whether an op is worth splitting, and rows [t0, t1) */
DI_INTERNAL int di_rms_norm_check(const di_rms_norm_args *a);
DI_INTERNAL int di_rms_norm_parallel(const di_rms_norm_args *a);
DI_INTERNAL void di_rms_norm_rows(const di_rms_norm_args *a, int t0, int t1);
DI_INTERNAL int di_rotary_check(const int64_t *positions, long P, int T, int D);
DI_INTERNAL int di_rotary_parallel(int T, int H, int Hkv, int D);
DI_INTERNAL void di_rotary_rows(float *q, long q_stride, int H, float *k, long k_stride, int Hkv,
                    const int64_t *positions, const float *cos_sin, int D, int t0, int t1);
DI_INTERNAL int di_store_kv_check(long num_slots, const int64_t *slots, int T, int width);
DI_INTERNAL void di_store_kv_rows(const float *k, long k_stride, const float *v, long v_stride,
                      void *k_cache, void *v_cache, const int64_t *slots, int width, int kv_f16,
                      int t0, int t1);
DI_INTERNAL int di_gated_mul_parallel(int T, int I); /* silu * up and gelu_tanh * up */
DI_INTERNAL void di_silu_mul_rows(const float *gu, long gu_stride, float *out, long out_stride, int I, int t0,
                      int t1);
DI_INTERNAL void di_gelu_tanh_mul_rows(const float *gu, long gu_stride, float *out, long out_stride, int I,
                           int t0, int t1);

/* int8_gemm.c: y = x @ W^T for an int8 di_matrix (its last N2 rows may be in a second format),
   with x quantized into q [M, K], dx and sx [M, K / 32] */
DI_INTERNAL void di_int8_matrix_team(const di_matrix *w, const float *x, float *y, int M,
                                     int8_t *q, float *dx, float *sx, di_team *team);

/* dequant.c: one row of K weights in `fmt`'s blocks (di_format_ok) as float32, gguf-py's values */
DI_INTERNAL void di_dequant_row(int fmt, const uint8_t *row, int K, float *out);

/* quant_gemm.c: `buf` is this thread's, di_quant_gemm_buffer_floats(K) floats, 64-byte aligned */
DI_INTERNAL long di_quant_gemm_buffer_floats(int K);
DI_INTERNAL void di_quant_gemm_team(int fmt, const uint8_t *w, const float *x, float *y, int M, int N, int K,
                        float *buf, di_team *team);

/* llama_layers.c: 1 where m is an [N, K] weight the quantized kernels take */
DI_INTERNAL int di_matrix_ok(const di_matrix *m, int N, int K);

/* paged_attention.c: a step's split of every request's keys into tasks, and their scratch */
typedef struct {
    int chunk; /* keys a task covers */
    int num_tasks;
    int *first; /* [B + 1]: request b's tasks are first[b] .. first[b + 1] - 1 */
    int *task_b; /* [num_tasks]: each task's request */
    float *parts; /* [num_tasks, H, D]: each task's unnormalized outputs */
    float *stats; /* [num_tasks, H, 2]: each task's maximum score and exponentials' sum a head */
    float *scores; /* [threads, G, chunk]: each thread's scores of one KV head */
    atomic_int next_task; /* the next task to claim */
} di_attention_plan;

DI_INTERNAL int di_attention_check(const di_attention_args *a);
/* The plan for `a`'s requests and lengths, for teams of up to `max_threads`; 0, or -2 when out
   of memory. The same plan serves every layer of a step (their lengths are the same). */
DI_INTERNAL int di_attention_plan_init(di_attention_plan *p, const di_attention_args *a, int max_threads);
DI_INTERNAL void di_attention_plan_free(di_attention_plan *p);
DI_INTERNAL void di_attention_team(const di_attention_args *a, di_attention_plan *p, di_team *team);

#endif
