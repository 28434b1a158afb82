/* A Llama decoder stack on CPU in one call: for each layer, the same native kernels the Python
   forward calls one by one (RMSNorm, the q/k/v, o, gate/up and down matmuls, rotary, the KV
   store, paged attention, silu * up), in the same order with the same arguments, so the result
   is bit-identical to that path; what it saves is ~13 Python calls a layer (tens of
   microseconds each: most of a one-stream decode step, a tenth of a 32-stream one).

   For steps whose every query the native attention kernel takes (decode rows, short chunks
   given one row per query), float32 activations and weights served by the quantized kernels
   (GGUF blocks with float32 activations, or int8-repacked). `deepinfer/kernels/llama_layers_cpu.py`
   checks all that and falls back to the Python forward otherwise.
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int di_quant_gemm(int fmt, const uint8_t *w, const float *x, float *y, int M, int N, int K,
                  int num_threads);
int di_int8_gemm(int fmt, const uint8_t *packed, const float *x, float *y, int M, int N, int K,
                 int num_threads);
int di_rms_norm(const float *x, long x_stride, const float *residual, long r_stride,
                const float *w, float *out, long out_stride, float *summed, long s_stride, int T,
                int D, float eps, int num_threads);
int di_rotary(float *q, long q_stride, int H, float *k, long k_stride, int Hkv,
              const int64_t *positions, const float *cos_sin, long P, int T, int D,
              int num_threads);
int di_store_kv(const float *k, long k_stride, const float *v, long v_stride, void *k_cache,
                void *v_cache, long num_slots, const int64_t *slots, int T, int width,
                int kv_f16);
int di_silu_mul(const float *gu, long gu_stride, float *out, long out_stride, int T, int I,
                int num_threads);
int di_paged_decode_attention(const float *q, long q_stride_b, long q_stride_h,
                              const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, int max_blocks,
                              const int32_t *context_lens, float *out, int B, int H, int Hkv,
                              int D, int S, float scale, int num_threads, int kv_f16);

typedef struct {
    const uint8_t *data; /* GGUF blocks (int8 == 0) or int8-repacked groups (int8 == 1) */
    int fmt, int8, N, K;
} di_matrix;

typedef struct {
    di_matrix qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    void *k_cache, *v_cache;
} di_llama_layer;

typedef struct {
    int T, hidden, H, Hkv, head_dim, intermediate;
    float eps, scale;
    const int64_t *positions;
    const float *cos_sin;
    long num_positions;
    const int64_t *slots;
    long num_slots;
    const int32_t *block_tables;
    int max_blocks;
    const int32_t *context_lens;
    int block_size, kv_f16, num_threads;
} di_llama_step;

static int linear(const di_matrix *w, const float *x, float *y, int M, int threads) {
    return w->int8 ? di_int8_gemm(w->fmt, w->data, x, y, M, w->N, w->K, threads)
                   : di_quant_gemm(w->fmt, w->data, x, y, M, w->N, w->K, threads);
}

#define TRY(call)                   \
    do {                            \
        const int status_ = (call); \
        if (status_ != 0) {         \
            rc = status_;           \
            goto done;              \
        }                           \
    } while (0)

/* h [T, hidden]: in, the first layer's input (embeddings) or the previous stack's output; out,
   the last layer's MLP output. residual [T, hidden]: the residual stream (in, when
   `has_residual`; out, before the last MLP output is added), as the Python forward keeps them.
   Returns 0, -1 on bad arguments, -2 when out of memory. */
int di_llama_layers(const di_llama_layer *layers, int num_layers, const di_llama_step *s,
                    float *h, float *residual, int has_residual) {
    const int T = s->T, D = s->hidden, hd = s->head_dim, I = s->intermediate;
    const int q_size = s->H * hd, kv_size = s->Hkv * hd, W = q_size + 2 * kv_size;
    const int thr = s->num_threads;
    if (T < 0 || num_layers < 0) return -1;
    if (T == 0 || num_layers == 0) return 0;
    int rc = 0;
    float *hn = malloc(sizeof(float) * (size_t)T * D);
    float *qkv = malloc(sizeof(float) * (size_t)T * W);
    float *attn = malloc(sizeof(float) * (size_t)T * q_size);
    float *gu = malloc(sizeof(float) * (size_t)T * 2 * I);
    float *act = malloc(sizeof(float) * (size_t)T * I);
    if (!hn || !qkv || !attn || !gu || !act) {
        rc = -2;
        goto done;
    }
    for (int l = 0; l < num_layers; l++) {
        const di_llama_layer *y = &layers[l];
        if (l == 0 && !has_residual) {
            TRY(di_rms_norm(h, D, NULL, 0, y->input_norm, hn, D, NULL, 0, T, D, s->eps, thr));
            memcpy(residual, h, sizeof(float) * (size_t)T * D);
        } else {
            TRY(di_rms_norm(h, D, residual, D, y->input_norm, hn, D, residual, D, T, D, s->eps,
                            thr));
        }
        TRY(linear(&y->qkv, hn, qkv, T, thr));
        float *q = qkv, *k = qkv + q_size, *v = qkv + q_size + kv_size;
        TRY(di_rotary(q, W, s->H, k, W, s->Hkv, s->positions, s->cos_sin, s->num_positions, T,
                      hd, thr));
        TRY(di_store_kv(k, W, v, W, y->k_cache, y->v_cache, s->num_slots, s->slots, T, kv_size,
                        s->kv_f16));
        TRY(di_paged_decode_attention(q, W, hd, y->k_cache, y->v_cache, s->block_tables,
                                      s->max_blocks, s->context_lens, attn, T, s->H, s->Hkv, hd,
                                      s->block_size, s->scale, thr, s->kv_f16));
        TRY(linear(&y->o, attn, h, T, thr));
        TRY(di_rms_norm(h, D, residual, D, y->post_norm, hn, D, residual, D, T, D, s->eps, thr));
        TRY(linear(&y->gate_up, hn, gu, T, thr));
        TRY(di_silu_mul(gu, 2 * I, act, I, T, I, thr));
        TRY(linear(&y->down, act, h, T, thr));
    }
done:
    free(hn);
    free(qkv);
    free(attn);
    free(gu);
    free(act);
    return rc;
}
