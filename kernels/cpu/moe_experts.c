/* A Mixture-of-Experts layer's experts on CPU in one call: runs of rows sorted by expert (each
   run all one expert's), each run through its expert's gate_up matmul, silu(gate) * up and its
   down matmul. The same kernels, arguments and order as the Python path's three calls a run
   (block_linear, silu_mul, block_linear), so the outputs are bit-identical; it saves those
   calls (three a run, tens of microseconds each: 64 experts make hundreds a layer) and
   OpenMP's fork and join per call: the whole layer is one parallel region whose threads share
   out each matmul and meet at spinning barriers (cpu/team.h). */
#include <stdint.h>
#include <stdlib.h>

#include "blocks.h"
#include "deepinfer_kernels.h"
#include "parts.h"

typedef struct {
    float *gu, *act;
    int8_t *q8;
    float *dx, *sx;
    float *tiles; /* per thread: di_quant_gemm_buffer_floats(max K) floats */
    long tile_floats;
} expert_buffers;

static void run_linear(const di_matrix *w, const float *x, float *y, int M,
                       const expert_buffers *b, di_team *team) {
    if (w->int8) {
        di_int8_matrix_team(w, x, y, M, b->q8, b->dx, b->sx, team);
    } else {
        float *tile = b->tiles + team->ith * b->tile_floats;
        di_quant_gemm_team(w->fmt, w->data, x, y, M, w->N, w->K, tile, team);
    }
    di_team_sync(team);
}

static void run_expert(const di_matrix *gate_up, const di_matrix *down, const float *x, float *y,
                       int M, int I, const expert_buffers *b, di_team *team) {
    run_linear(gate_up, x, b->gu, M, b, team);
    int t0 = 0, t1 = team->ith == 0 ? M : 0;
    if (di_gated_mul_parallel(M, I)) di_team_range(team, M, &t0, &t1);
    di_silu_mul_rows(b->gu, 2L * I, b->act, I, I, t0, t1);
    di_team_sync(team);
    run_linear(down, b->act, y, M, b, team);
}

static int check(const di_matrix *gate_up, const di_matrix *down, int E, int num_runs,
                 const int *experts, const int *rows, int D, int I, int *max_rows) {
    if (E <= 0 || num_runs < 0 || D <= 0 || I <= 0 || D % 8 || I % 8) return -1;
    for (int e = 0; e < E; e++) {
        if (!di_matrix_ok(&gate_up[e], 2 * I, D) || !di_matrix_ok(&down[e], D, I)) return -1;
    }
    *max_rows = 0;
    for (int r = 0; r < num_runs; r++) {
        if (experts[r] < 0 || experts[r] >= E || rows[r] < 0) return -1;
        if (rows[r] > *max_rows) *max_rows = rows[r];
    }
    return 0;
}

static void free_buffers(expert_buffers *b) {
    free(b->gu);
    free(b->act);
    free(b->q8);
    free(b->dx);
    free(b->tiles);
}

static int alloc_buffers(expert_buffers *b, int max_rows, int D, int I, int threads) {
    const size_t T = (size_t)max_rows, K = (size_t)(D > I ? D : I);
    b->gu = malloc(sizeof(float) * T * 2 * (size_t)I);
    b->act = malloc(sizeof(float) * T * (size_t)I);
    b->q8 = aligned_alloc(64, (T * K + 63) / 64 * 64);
    b->dx = malloc(sizeof(float) * 2 * T * (K / DI_QK));
    b->sx = b->dx == NULL ? NULL : b->dx + T * (K / DI_QK);
    b->tile_floats = (di_quant_gemm_buffer_floats((int)K) + 15) / 16 * 16;
    b->tiles = aligned_alloc(64, sizeof(float) * (size_t)threads * (size_t)b->tile_floats);
    return b->gu && b->act && b->q8 && b->dx && b->tiles ? 0 : -2;
}

int di_moe_experts(const di_matrix *gate_up, const di_matrix *down, int E, int num_runs,
                   const int *experts, const int *rows, const float *x, float *y, int D, int I,
                   int num_threads) {
    int max_rows = 0;
    if (check(gate_up, down, E, num_runs, experts, rows, D, I, &max_rows) != 0) return -1;
    if (max_rows == 0) return 0;
    const int threads = num_threads > 0 ? num_threads : 1;
    expert_buffers b = {0};
    if (alloc_buffers(&b, max_rows, D, I, threads) != 0) {
        free_buffers(&b);
        return -2;
    }
    di_barrier barrier;
    di_barrier_init(&barrier);
#pragma omp parallel num_threads(threads)
    {
        di_team team = di_team_join(&barrier);
        long start = 0;
        for (int r = 0; r < num_runs; r++) {
            if (rows[r] > 0) {
                const int e = experts[r];
                run_expert(&gate_up[e], &down[e], x + start * D, y + start * D, rows[r], I, &b,
                           &team);
            }
            start += rows[r];
        }
    }
    free_buffers(&b);
    return 0;
}
