/* The sampler's greedy pick, float32 on x86-64 with AVX2: each row's first largest logit, in one
   pass over the row, where torch takes several ops and a tenth of a millisecond for one
   49k-token row.

   A row whose largest value is not finite gets -1 (a NaN anywhere, +inf, or nothing above -inf):
   the sampler repairs those rows (sampling/sampler.py), as it does after torch's argmax.
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "deepinfer_kernels.h"

/* One pass: per lane, the first largest value and its index (four independent chains of max and
   blend keep up with memory; a second pass to find the index would read the row again). Then
   the smallest index among the lanes holding the row's largest value. */
#define ARGMAX_CHAINS 4
#define ARGMAX_AHEAD 512 /* floats: 2 KB */

static int64_t argmax_row(const float *x, int V) {
    __m256 best[ARGMAX_CHAINS], where[ARGMAX_CHAINS];
    __m256 nan = _mm256_setzero_ps();
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int c = 0; c < ARGMAX_CHAINS; c++) {
        best[c] = _mm256_set1_ps(-INFINITY);
        where[c] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    }
    int i = 0;
    for (; i + 8 * ARGMAX_CHAINS <= V; i += 8 * ARGMAX_CHAINS) {
        /* Read ahead without keeping the row in the shared caches: a step's logits are tens of
           megabytes, read once, and would otherwise evict what the serving threads work on. */
        _mm_prefetch((const char *)(x + i + ARGMAX_AHEAD), _MM_HINT_NTA);
        _mm_prefetch((const char *)(x + i + ARGMAX_AHEAD + 16), _MM_HINT_NTA);
        for (int c = 0; c < ARGMAX_CHAINS; c++) {
            const int at = i + 8 * c;
            const __m256 v = _mm256_loadu_ps(x + at);
            const __m256 index = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_set1_epi32(at), lanes));
            const __m256 gt = _mm256_cmp_ps(v, best[c], _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best[c] = _mm256_blendv_ps(best[c], v, gt);
            where[c] = _mm256_blendv_ps(where[c], index, gt);
        }
    }
    if (_mm256_movemask_ps(nan)) return -1;
    float m = -INFINITY;
    int64_t arg = -1;
    for (int c = 0; c < ARGMAX_CHAINS; c++) {
        float value[8];
        int32_t index[8];
        _mm256_storeu_ps(value, best[c]);
        _mm256_storeu_si256((__m256i *)index, _mm256_castps_si256(where[c]));
        for (int j = 0; j < 8; j++) {
            if (value[j] > m || (value[j] == m && index[j] >= 0 && index[j] < arg)) {
                m = value[j];
                arg = index[j];
            }
        }
    }
    for (; i < V; i++) {
        if (isnan(x[i])) return -1;
        if (x[i] > m) {
            m = x[i];
            arg = i;
        }
    }
    return isfinite(m) ? arg : -1;
}

/* Rows split over `threads` OpenMP threads when the batch is big enough to pay for the team
   (16 MB of logits or more: a decode step of a hundred rows over a 50k vocabulary), handed out
   a few at a time: a helper the kernel wakes late (its core busy serving) takes fewer rows
   instead of holding the caller at the barrier for a fixed half. */
int di_argmax_rows(const float *x, long stride, int rows, int V, int64_t *out, int threads) {
    if (rows < 0 || V <= 0 || stride < V) return -1;
    const int parallel = threads > 1 && (long)rows * V >= (1L << 22);
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads > 1 ? threads : 1) if (parallel)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, V);
    return 0;
}
