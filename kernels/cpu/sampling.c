/* The sampler's greedy pick, float32 on x86-64 with AVX2: each row's first largest logit, in two
   passes over a row that stays in L2 (the largest value, then its first index), where torch
   takes several ops and a tenth of a millisecond for one 49k-token row.

   A row whose largest value is not finite gets -1 (a NaN anywhere, +inf, or nothing above -inf):
   the sampler repairs those rows (sampling/sampler.py), as it does after torch's argmax.
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "deepinfer_kernels.h"

static int64_t argmax_row(const float *x, int V) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_max_ps(best, v);
    }
    float top[8];
    _mm256_storeu_ps(top, best);
    float m = -INFINITY;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int j = 0; j < 8; j++) m = top[j] > m ? top[j] : m;
    for (int j = i; j < V; j++) {
        any_nan |= isnan(x[j]);
        m = x[j] > m ? x[j] : m;
    }
    if (any_nan || !isfinite(m)) return -1;
    const __m256 target = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= V; i += 8) {
        const __m256 eq = _mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ);
        const int hits = _mm256_movemask_ps(eq);
        if (hits) return i + __builtin_ctz((unsigned)hits);
    }
    for (; i < V; i++) {
        if (x[i] == m) return i;
    }
    return -1; /* unreachable: m is one of the row's values */
}

/* Rows split over `threads` OpenMP threads when the batch is big enough to pay for the team
   (16 MB of logits or more: a decode step of a hundred rows over a 50k vocabulary). */
int di_argmax_rows(const float *x, long stride, int rows, int V, int64_t *out, int threads) {
    if (rows < 0 || V <= 0 || stride < V) return -1;
    const int parallel = threads > 1 && (long)rows * V >= (1L << 22);
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1) if (parallel)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, V);
    return 0;
}
