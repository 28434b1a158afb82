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

#include "deepinfer_kernels.h"

static int linear(const di_matrix *w, const float *x, float *y, int M, int threads) {
    return w->int8 ? di_int8_gemm(w->fmt, w->data, x, y, M, w->N, w->K, threads)
                   : di_quant_gemm(w->fmt, w->data, x, y, M, w->N, w->K, threads);
}

/* out = rms_norm(h (+ residual)) * w over the step's rows; with a residual, the sum is written
   back into it (the residual stream, updated in place). */
static int rms_norm(const float *h, float *residual, const float *w, float *out,
                    const di_llama_step *s) {
    const long D = s->hidden, residual_stride = residual != NULL ? D : 0;
    const di_rms_norm_args a = {
        .x = h, .x_stride = D, .residual = residual, .residual_stride = residual_stride,
        .w = w, .out = out, .out_stride = D, .summed = residual, .summed_stride = residual_stride,
        .T = s->T, .D = s->hidden, .eps = s->eps, .num_threads = s->num_threads};
    return di_rms_norm(&a);
}

/* out [T, H * head_dim] = attention of q (rows `q_stride` apart) over one layer's caches. */
static int attention(const float *q, long q_stride, const di_llama_layer *y, float *out,
                     const di_llama_step *s) {
    const di_attention_args a = {
        .q = q, .q_stride_b = q_stride, .q_stride_h = s->head_dim, .k_cache = y->k_cache,
        .v_cache = y->v_cache, .block_tables = s->block_tables, .max_blocks = s->max_blocks,
        .context_lens = s->context_lens, .out = out, .B = s->T, .H = s->H, .Hkv = s->Hkv,
        .D = s->head_dim, .S = s->block_size, .scale = s->scale,
        .num_threads = s->num_threads, .kv_f16 = s->kv_f16};
    return di_paged_decode_attention(&a);
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
            TRY(rms_norm(h, NULL, y->input_norm, hn, s));
            memcpy(residual, h, sizeof(float) * (size_t)T * D);
        } else {
            TRY(rms_norm(h, residual, y->input_norm, hn, s));
        }
        TRY(linear(&y->qkv, hn, qkv, T, thr));
        float *q = qkv, *k = qkv + q_size, *v = qkv + q_size + kv_size;
        TRY(di_rotary(q, W, s->H, k, W, s->Hkv, s->positions, s->cos_sin, s->num_positions, T,
                      hd, thr));
        TRY(di_store_kv(k, W, v, W, y->k_cache, y->v_cache, s->num_slots, s->slots, T, kv_size,
                        s->kv_f16));
        TRY(attention(q, W, y, attn, s));
        TRY(linear(&y->o, attn, h, T, thr));
        TRY(rms_norm(h, residual, y->post_norm, hn, s));
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
