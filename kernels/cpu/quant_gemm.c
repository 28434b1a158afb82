/* Matmuls over GGUF block-quantized weights on x86-64 CPUs with AVX2, FMA and F16C.

   y[M, N] = x[M, K] @ W[N, K]^T, W stored as llama.cpp's blocks, row after row, in any format
   of cpu/blocks.h (Q4_1, Q8_0; the K-quants Q4_K, Q5_K, Q6_K). Weights are dequantized exactly
   as gguf-py does (cpu/dequant.c), so the values multiplied are the reference's fp32 weights,
   bit for bit; only the order of the sum over K differs from a BLAS call.

   Work is split over tiles of NR weight rows (OpenMP, `num_threads` given by the caller: the
   calling worker thread's torch share). A tile is dequantized once into a per-thread fp32
   buffer (NR * K floats, L1/L2 resident) and multiplied with every row of x, two at a time.
   Each output is the same sum in the same order whatever M is (8 lanes over K, then a fixed
   horizontal reduction): results do not depend on the batch.
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "deepinfer_kernels.h"
#include "parts.h"
#include "simd.h"

#define NR 4

/* NR weight rows (w, stride K) times MR x rows (MR = 1..3), into y (row stride N). Each output
   has its own accumulator, summed over K in ascending steps of 8 lanes, then reduced by hsum8:
   the same arithmetic for every MR, so results never depend on how rows were grouped. */
#define TILE(MR)                                                                              \
    static inline void tile_x##MR(const float *w, const float *x, int K, float *y, int N) {   \
        __m256 acc[NR][MR];                                                                   \
        for (int r = 0; r < NR; r++)                                                          \
            for (int c = 0; c < MR; c++) acc[r][c] = _mm256_setzero_ps();                     \
        for (int k = 0; k < K; k += 8) {                                                      \
            __m256 v[MR];                                                                     \
            for (int c = 0; c < MR; c++) v[c] = _mm256_loadu_ps(x + (size_t)c * K + k);       \
            for (int r = 0; r < NR; r++) {                                                    \
                const __m256 wr = _mm256_loadu_ps(w + (size_t)r * K + k);                     \
                for (int c = 0; c < MR; c++) acc[r][c] = _mm256_fmadd_ps(wr, v[c], acc[r][c]); \
            }                                                                                 \
        }                                                                                     \
        for (int c = 0; c < MR; c++)                                                          \
            for (int r = 0; r < NR; r++) y[(size_t)c * N + r] = hsum8(acc[r][c]);             \
    }
TILE(1)
TILE(2)
TILE(3)

/* One weight row times one x row, with the same arithmetic as the tiles. */
static inline float dot_row(const float *w, const float *x, int K) {
    __m256 a = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a);
    }
    return hsum8(a);
}

static void tile_rows(const float *w, int nr, const float *x, int M, int K, float *y, int N) {
    if (nr < NR) { /* the last rows of W: one at a time */
        for (int m = 0; m < M; m++)
            for (int r = 0; r < nr; r++)
                y[(size_t)m * N + r] = dot_row(w + (size_t)r * K, x + (size_t)m * K, K);
        return;
    }
    int m = 0;
    for (; m + 3 <= M; m += 3) tile_x3(w, x + (size_t)m * K, K, y + (size_t)m * N, N);
    if (M - m == 2) tile_x2(w, x + (size_t)m * K, K, y + (size_t)m * N, N);
    if (M - m == 1) tile_x1(w, x + (size_t)m * K, K, y + (size_t)m * N, N);
}

void di_quant_gemm_team(int fmt, const uint8_t *w, const float *x, float *y, int M, int N, int K,
                        float *buf, di_team *team) {
    const size_t rb = di_row_bytes(fmt, K);
    int t0, t1;
    di_team_range(team, (N + NR - 1) / NR, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        const int n0 = t * NR;
        const int nr = N - n0 < NR ? N - n0 : NR;
        for (int r = 0; r < nr; r++) {
            di_dequant_row(fmt, w + (size_t)(n0 + r) * rb, K, buf + (size_t)r * K);
        }
        tile_rows(buf, nr, x, M, K, y + n0, N);
    }
}

long di_quant_gemm_buffer_floats(int K) { return (long)NR * K; }

/* Returns 0 on success, -1 on bad arguments, -2 when out of memory. */
int di_quant_gemm(int fmt, const uint8_t *w, const float *x, float *y, int M, int N, int K,
                  int num_threads) {
    if (!di_format_ok(fmt, K) || M < 0 || N < 0) return -1;
    int failed = 0;
    di_barrier barrier;
    di_barrier_init(&barrier);
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        di_team team = di_team_join(&barrier);
        float *buf = aligned_alloc(64, ((size_t)NR * K * sizeof(float) + 63) / 64 * 64);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) di_quant_gemm_team(fmt, w, x, y, M, N, K, buf, &team);
        free(buf);
    }
    return failed ? -2 : 0;
}
