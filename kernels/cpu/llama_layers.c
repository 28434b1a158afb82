/* A Llama-family decoder stack on CPU in one call: for each layer, the same kernels the Python
   forward calls one by one (RMSNorm, the q/k/v, o, gate/up and down matmuls, the q/k norms,
   rotary, the KV store, paged attention over the layer's window, silu or gelu_tanh * up, and
   Gemma 3's norms of the attention and MLP outputs), in the same order on the same rows, so the
   result is bit-identical to that path. What it saves: ~13 Python calls a layer (tens of
   microseconds each: most of a one-stream decode step, a tenth of a 32-stream one), and
   OpenMP's fork, join and futex waits: the whole stack is one parallel region whose threads share out each op
   (cpu/parts.h) and meet at spinning barriers between ops (cpu/team.h). The sliding-window
   layers may keep their KV in a paged pool of their own (di_llama_step's window_* fields).

   For steps whose every query the native attention kernel takes (decode rows, short chunks
   given one row per query), float32 activations and weights served by the quantized kernels
   (GGUF blocks with float32 activations, or int8-repacked). `kernels/layers/llama_layers_cpu.py`
   checks all that and falls back to the Python forward otherwise.
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "deepinfer_kernels.h"
#include "parts.h"

int di_matrix_ok(const di_matrix *m, int N, int K) {
    if (m->N != N || m->K != K) return 0;
    if (m->int8) return di_int8_split_packed_bytes(m->fmt, m->fmt2, m->N2, N, K) > 0;
    return m->N2 == 0 && di_format_ok(m->fmt, K);
}

/* What the region's threads share: the step, its buffers, and the attention plans. */
typedef struct {
    const di_llama_step *s;
    float *hn, *qkv, *attn, *gu, *act;
    int8_t *q8;
    float *dx, *sx;
    float *tiles; /* per thread: di_quant_gemm_buffer_floats(max K) floats */
    long tile_floats;
    di_attention_plan *plans; /* one per distinct window among the layers */
    int num_plans;
    int *plan_of; /* [num_layers]: each layer's plan */
} stack_buffers;

static void linear(const di_matrix *w, const float *x, float *y, const stack_buffers *b,
                   di_team *team) {
    const int M = b->s->T;
    if (w->int8) {
        di_int8_matrix_team(w, x, y, M, b->q8, b->dx, b->sx, team);
    } else {
        float *tile = b->tiles + team->ith * b->tile_floats;
        di_quant_gemm_team(w->fmt, w->data, x, y, M, w->N, w->K, tile, team);
    }
    di_team_sync(team);
}

/* Rows [t0, t1) of this thread for a row-wise op: a share when the op is worth splitting, else
   all of them on the first thread. */
static void rows_of(const di_team *team, int T, int split, int *t0, int *t1) {
    if (split) {
        di_team_range(team, T, t0, t1);
    } else {
        *t0 = 0;
        *t1 = team->ith == 0 ? T : 0;
    }
}

/* out = rms_norm(h (+ residual)) * w; with a residual, the sum is written back into it (the
   residual stream, updated in place). Without one, h is copied into `residual` unless that is
   NULL (a plain norm, which may write over h itself). */
static void rms_norm(const float *h, float *residual, int has_residual, const float *w,
                     float *out, const stack_buffers *b, di_team *team) {
    const di_llama_step *s = b->s;
    const long D = s->hidden;
    const di_rms_norm_args a = {
        .x = h, .x_stride = D, .residual = has_residual ? residual : NULL,
        .residual_stride = has_residual ? D : 0, .w = w, .out = out, .out_stride = D,
        .summed = has_residual ? residual : NULL, .summed_stride = has_residual ? D : 0,
        .T = s->T, .D = s->hidden, .eps = s->eps, .num_threads = s->num_threads};
    int t0, t1;
    rows_of(team, s->T, di_rms_norm_parallel(&a), &t0, &t1);
    di_rms_norm_rows(&a, t0, t1);
    if (!has_residual && residual != NULL && t1 > t0) {
        memcpy(residual + t0 * D, h + t0 * D, sizeof(float) * (size_t)(t1 - t0) * D);
    }
    di_team_sync(team);
}

/* Every head of tokens [t0, t1) of x [T, heads, head_dim] (token stride given) RMS-normalized
   in place by w, where w is not NULL: the rows the cpu backend's rms_norm of that view
   computes. */
static void head_norm(float *x, long stride, int heads, const float *w, const di_llama_step *s,
                      int t0, int t1) {
    if (w == NULL) return;
    for (int t = t0; t < t1; t++) {
        float *row = x + t * stride;
        const di_rms_norm_args a = {
            .x = row, .x_stride = s->head_dim, .w = w, .out = row, .out_stride = s->head_dim,
            .T = heads, .D = s->head_dim, .eps = s->eps, .num_threads = 1};
        di_rms_norm_rows(&a, 0, heads);
    }
}

/* One paged KV pool as the step addresses it: the rows new tokens are stored at, the tables. */
typedef struct {
    const int64_t *slots;
    long num_slots;
    const int32_t *block_tables;
    int max_blocks;
} kv_pool;

/* A sliding-window layer's pool is the step's window_* one where the step has it (the windowed
   layers' KV then lives apart from the full layers'), else the one every layer shares. */
static int in_window_pool(const di_llama_layer *y, const di_llama_step *s) {
    return y->window > 0 && s->window_slots != NULL;
}

static kv_pool pool_of(const di_llama_layer *y, const di_llama_step *s) {
    if (in_window_pool(y, s)) {
        return (kv_pool){s->window_slots, s->window_num_slots, s->window_block_tables,
                         s->window_max_blocks};
    }
    return (kv_pool){s->slots, s->num_slots, s->block_tables, s->max_blocks};
}

static di_attention_args attention_args(const float *q, long q_stride, const di_llama_layer *y,
                                        float *out, const di_llama_step *s) {
    const kv_pool pool = pool_of(y, s);
    const di_attention_args a = {
        .q = q, .q_stride_b = q_stride, .q_stride_h = s->head_dim, .k_cache = y->k_cache,
        .v_cache = y->v_cache, .block_tables = pool.block_tables, .max_blocks = pool.max_blocks,
        .context_lens = s->context_lens, .out = out, .B = s->T, .H = s->H, .Hkv = s->Hkv,
        .D = s->head_dim, .S = s->block_size, .scale = s->scale,
        .num_threads = s->num_threads, .kv_f16 = s->kv_f16, .window = y->window};
    return a;
}

/* b->attn = attention of the q/k/v rows in b->qkv: their bias, q/k norms and rotary in place and the
   KV store (per-token ops: a thread's tokens go through all three), then paged attention. */
static void attention(const di_llama_layer *y, di_attention_plan *plan, stack_buffers *b,
                      di_team *team) {
    const di_llama_step *s = b->s;
    const int T = s->T, hd = s->head_dim;
    const int q_size = s->H * hd, kv_size = s->Hkv * hd, W = q_size + 2 * kv_size;
    float *q = b->qkv, *k = b->qkv + q_size, *v = b->qkv + q_size + kv_size;
    int t0, t1;
    rows_of(team, T, di_rotary_parallel(T, s->H, s->Hkv, hd), &t0, &t1);
    if (y->qkv_bias != NULL) {
        for (int t = t0; t < t1; t++) {
            float *row = b->qkv + (size_t)t * W;
            for (int j = 0; j < W; j++) row[j] += y->qkv_bias[j];
        }
    }
    head_norm(q, W, s->H, y->q_norm, s, t0, t1);
    head_norm(k, W, s->Hkv, y->k_norm, s, t0, t1);
    di_rotary_rows(q, W, s->H, k, W, s->Hkv, s->positions, y->cos_sin, hd, t0, t1);
    di_store_kv_rows(k, W, v, W, y->k_cache, y->v_cache, pool_of(y, s).slots, kv_size, s->kv_f16,
                     t0, t1);
    di_team_sync(team);
    const di_attention_args a = attention_args(q, W, y, b->attn, s);
    di_attention_team(&a, plan, team);
    di_team_sync(team);
}

/* h = down(act(gate) * up) of the rows in b->hn. */
static void mlp(const di_llama_layer *y, stack_buffers *b, float *h, di_team *team) {
    const int T = b->s->T, I = b->s->intermediate;
    linear(&y->gate_up, b->hn, b->gu, b, team);
    int t0, t1;
    rows_of(team, T, di_gated_mul_parallel(T, I), &t0, &t1);
    if (y->activation == DI_ACT_GELU_TANH) {
        di_gelu_tanh_mul_rows(b->gu, 2 * I, b->act, I, I, t0, t1);
    } else {
        di_silu_mul_rows(b->gu, 2 * I, b->act, I, I, t0, t1);
    }
    di_team_sync(team);
    linear(&y->down, b->act, h, b, team);
}

static void layer(const di_llama_layer *y, di_attention_plan *plan, int first, stack_buffers *b,
                  float *h, float *residual, di_team *team) {
    rms_norm(h, residual, !first, y->input_norm, b->hn, b, team);
    linear(&y->qkv, b->hn, b->qkv, b, team);
    attention(y, plan, b, team);
    linear(&y->o, b->attn, h, b, team);
    if (y->attn_out_norm != NULL) rms_norm(h, NULL, 0, y->attn_out_norm, h, b, team);
    rms_norm(h, residual, 1, y->post_norm, b->hn, b, team);
    mlp(y, b, h, team);
    if (y->mlp_out_norm != NULL) rms_norm(h, NULL, 0, y->mlp_out_norm, h, b, team);
}

static int check_layer(const di_llama_layer *y, const di_llama_step *s) {
    const int D = s->hidden, hd = s->head_dim, I = s->intermediate;
    const int q_size = s->H * hd, kv_size = s->Hkv * hd, W = q_size + 2 * kv_size;
    const di_attention_args a = attention_args(NULL, W, y, NULL, s);
    if (di_attention_check(&a) != 0) return -1;
    if (y->input_norm == NULL || y->post_norm == NULL || y->cos_sin == NULL) return -1;
    if (y->activation != DI_ACT_SILU && y->activation != DI_ACT_GELU_TANH) return -1;
    if (!di_matrix_ok(&y->qkv, W, D) || !di_matrix_ok(&y->o, D, q_size) ||
        !di_matrix_ok(&y->gate_up, 2 * I, D) || !di_matrix_ok(&y->down, D, I)) {
        return -1;
    }
    return 0;
}

/* Each pool's slots are checked where a layer stores into them, and only there: a stack of the
   full layers alone (or of windowed ones alone) may be handed the slots of a pool it does not
   have, sized for another. */
static int check_pools(const di_llama_layer *layers, int num_layers, const di_llama_step *s) {
    const int kv_size = s->Hkv * s->head_dim;
    int main_used = 0, window_used = 0;
    for (int l = 0; l < num_layers; l++) {
        if (in_window_pool(&layers[l], s)) {
            window_used = 1;
        } else {
            main_used = 1;
        }
    }
    if (main_used && di_store_kv_check(s->num_slots, s->slots, s->T, kv_size) != 0) return -1;
    if (!window_used) return 0;
    if (s->window_block_tables == NULL) return -1;
    return di_store_kv_check(s->window_num_slots, s->window_slots, s->T, kv_size);
}

static int check(const di_llama_layer *layers, int num_layers, const di_llama_step *s) {
    const int I = s->intermediate;
    const di_rms_norm_args norm = {.T = s->T, .D = s->hidden};
    if (di_rms_norm_check(&norm) != 0 || I <= 0 || I % 8 != 0) return -1;
    if (di_rotary_check(s->positions, s->num_positions, s->T, s->head_dim) != 0) return -1;
    if (check_pools(layers, num_layers, s) != 0) return -1;
    for (int l = 0; l < num_layers; l++) {
        if (check_layer(&layers[l], s) != 0) return -1;
    }
    return 0;
}

static void free_buffers(stack_buffers *b) {
    free(b->hn);
    free(b->qkv);
    free(b->attn);
    free(b->gu);
    free(b->act);
    free(b->q8);
    free(b->dx);
    free(b->tiles);
    for (int p = 0; p < b->num_plans; p++) di_attention_plan_free(&b->plans[p]);
    free(b->plans);
    free(b->plan_of);
}

/* One attention plan per distinct window (a plan's tasks cover the keys its window reads); the
   layers of one window share theirs. A plan depends on the context lengths and the window, never
   on block tables, and every layer of one window is in one pool (pool_of), so a plan per window
   is one per (window, pool) as well. */
static int plan_attention(stack_buffers *b, const di_llama_layer *layers, int num_layers,
                          int threads) {
    b->plans = calloc((size_t)num_layers, sizeof(di_attention_plan));
    b->plan_of = malloc(sizeof(int) * (size_t)num_layers);
    if (b->plans == NULL || b->plan_of == NULL) return -2;
    for (int l = 0; l < num_layers; l++) {
        int j = 0;
        while (j < l && layers[j].window != layers[l].window) j++;
        if (j < l) {
            b->plan_of[l] = b->plan_of[j];
            continue;
        }
        const di_attention_args a = attention_args(NULL, 0, &layers[l], NULL, b->s);
        if (di_attention_plan_init(&b->plans[b->num_plans], &a, threads) != 0) return -2;
        b->plan_of[l] = b->num_plans++;
    }
    return 0;
}

static int alloc_buffers(stack_buffers *b, const di_llama_layer *layers, int num_layers,
                         const di_llama_step *s, int threads) {
    const size_t T = (size_t)s->T, D = (size_t)s->hidden, I = (size_t)s->intermediate;
    const size_t q_size = (size_t)s->H * s->head_dim, kv_size = (size_t)s->Hkv * s->head_dim;
    size_t max_k = D > I ? D : I;
    max_k = max_k > q_size ? max_k : q_size;
    b->s = s;
    b->hn = malloc(sizeof(float) * T * D);
    b->qkv = malloc(sizeof(float) * T * (q_size + 2 * kv_size));
    b->attn = malloc(sizeof(float) * T * q_size);
    b->gu = malloc(sizeof(float) * T * 2 * I);
    b->act = malloc(sizeof(float) * T * I);
    b->q8 = aligned_alloc(64, (T * max_k + 63) / 64 * 64);
    b->dx = malloc(sizeof(float) * 2 * T * (max_k / DI_QK));
    b->sx = b->dx == NULL ? NULL : b->dx + T * (max_k / DI_QK);
    b->tile_floats = (di_quant_gemm_buffer_floats((int)max_k) + 15) / 16 * 16;
    b->tiles = aligned_alloc(64, sizeof(float) * (size_t)threads * (size_t)b->tile_floats);
    if (!b->hn || !b->qkv || !b->attn || !b->gu || !b->act || !b->q8 || !b->dx || !b->tiles) {
        return -2;
    }
    return plan_attention(b, layers, num_layers, threads);
}

/* h [T, hidden]: in, the first layer's input (embeddings) or the previous stack's output; out,
   the last layer's MLP output (normed by its mlp_out_norm, where it has one). residual
   [T, hidden]: the residual stream (in, when `has_residual`; out, before the last MLP output
   is added), as the Python forward keeps them. Returns 0, -1 on bad arguments, -2 when out of
   memory. */
int di_llama_layers(const di_llama_layer *layers, int num_layers, const di_llama_step *s,
                    float *h, float *residual, int has_residual) {
    if (s->T < 0 || num_layers < 0) return -1;
    if (s->T == 0 || num_layers == 0) return 0;
    if (check(layers, num_layers, s) != 0) return -1;
    const int threads = s->num_threads > 0 ? s->num_threads : 1;
    stack_buffers b = {0};
    if (alloc_buffers(&b, layers, num_layers, s, threads) != 0) {
        free_buffers(&b);
        return -2;
    }
    di_barrier barrier;
    di_barrier_init(&barrier);
#pragma omp parallel num_threads(threads)
    {
        di_team team = di_team_join(&barrier);
        for (int l = 0; l < num_layers; l++) {
            layer(&layers[l], &b.plans[b.plan_of[l]], l == 0 && !has_residual, &b, h, residual,
                  &team);
        }
    }
    free_buffers(&b);
    return 0;
}
