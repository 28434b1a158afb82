/* The small per-layer ops of a CPU forward pass, float32, on x86-64 with AVX2, FMA and F16C:
   residual add + RMSNorm, rotary embedding in place, the KV store and the MLP's gated
   activations. In torch each is several ops with temporaries; here each is one pass over rows
   that stay in L1.

   Rows are given by a base pointer and a row stride in elements (q, k and v are views of the
   fused qkv projection). Work is split over rows with OpenMP when there are enough of them
   (`num_threads` is the calling worker's torch share). This file is compiled with
   -ffp-contract=off: every product and sum rounds as torch's references round them, except the
   order of the RMSNorm's sum of squares (8 lanes, then a fixed reduction), silu's and
   gelu_tanh's exp (simd.h's exp8, within 2 ulps) and gelu_tanh's formula (gelu_tanh8).
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "deepinfer_kernels.h"
#include "parts.h"
#include "simd.h"

#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* out = rms_norm(x (+ residual)) * weight; with a residual, summed = x + residual as well.
   D must be a multiple of 8. */
static void norm_row(const float *x, const float *residual, const float *w, float *out,
                     float *summed, int D, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (residual != NULL) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(residual + i));
            _mm256_storeu_ps(summed + i, v);
        }
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    const float *src = residual != NULL ? summed : x;
    const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)D + eps));
    for (int i = 0; i < D; i += 8) {
        const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(src + i), r);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(normed, _mm256_loadu_ps(w + i)));
    }
}

int di_rms_norm_check(const di_rms_norm_args *a) {
    const int D = a->D;
    return a->T < 0 || D <= 0 || D % 8 != 0 || (a->residual != NULL && a->summed == NULL) ? -1 : 0;
}

void di_rms_norm_rows(const di_rms_norm_args *a, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        norm_row(a->x + t * a->x_stride,
                 a->residual != NULL ? a->residual + t * a->residual_stride : NULL, a->w,
                 a->out + t * a->out_stride,
                 a->summed != NULL ? a->summed + t * a->summed_stride : NULL, a->D, a->eps);
    }
}

int di_rms_norm_parallel(const di_rms_norm_args *a) {
    return (long)a->T * a->D >= PARALLEL_MIN_ELEMENTS;
}

/* See di_rms_norm_args in deepinfer_kernels.h. */
int di_rms_norm(const di_rms_norm_args *a) {
    if (di_rms_norm_check(a) != 0) return -1;
    const int threads = di_rms_norm_parallel(a) && a->num_threads > 1 ? a->num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < a->T; t++) di_rms_norm_rows(a, t, t + 1);
    return 0;
}

/* One head of one token, rotate-half layout: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. */
static inline void rotate_head(float *x, const float *cos, const float *sin, int half) {
    int i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
        const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
    }
    for (; i < half; i++) {
        const float a = x[i], b = x[half + i];
        x[i] = a * cos[i] - b * sin[i];
        x[half + i] = b * cos[i] + a * sin[i];
    }
}

int di_rotary_check(const int64_t *positions, long P, int T, int D) {
    if (T < 0 || D <= 0 || D % 2 != 0) return -1;
    for (int t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= P) return -1;
    }
    return 0;
}

void di_rotary_rows(float *q, long q_stride, int H, float *k, long k_stride, int Hkv,
                    const int64_t *positions, const float *cos_sin, int D, int t0, int t1) {
    const int half = D / 2;
    for (int t = t0; t < t1; t++) {
        const float *row = cos_sin + positions[t] * (long)D;
        for (int h = 0; h < H; h++) rotate_head(q + t * q_stride + (long)h * D, row, row + half, half);
        for (int h = 0; h < Hkv; h++) rotate_head(k + t * k_stride + (long)h * D, row, row + half, half);
    }
}

int di_rotary_parallel(int T, int H, int Hkv, int D) {
    return (long)T * (H + Hkv) * D >= PARALLEL_MIN_ELEMENTS;
}

/* q [T, H, D] and k [T, Hkv, D] in place (token strides given, heads contiguous at D apart);
   cos_sin [P, D] (cos in the first half, sin in the second); positions [T] int64 < P. */
int di_rotary(float *q, long q_stride, int H, float *k, long k_stride, int Hkv,
              const int64_t *positions, const float *cos_sin, long P, int T, int D,
              int num_threads) {
    if (di_rotary_check(positions, P, T, D) != 0) return -1;
    const int threads = di_rotary_parallel(T, H, Hkv, D) && num_threads > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < T; t++) {
        di_rotary_rows(q, q_stride, H, k, k_stride, Hkv, positions, cos_sin, D, t, t + 1);
    }
    return 0;
}

static inline void store_row(const float *src, void *dst, int width, int f16) {
    if (!f16) {
        memcpy(dst, src, (size_t)width * sizeof(float));
        return;
    }
    uint16_t *o = (uint16_t *)dst;
    int i = 0;
    for (; i + 8 <= width; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(o + i), h);
    }
    for (; i < width; i++) o[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

int di_store_kv_check(long num_slots, const int64_t *slots, int T, int width) {
    if (T < 0 || width <= 0) return -1;
    for (int t = 0; t < T; t++) {
        if (slots[t] >= num_slots) return -1;
    }
    return 0;
}

void di_store_kv_rows(const float *k, long k_stride, const float *v, long v_stride,
                      void *k_cache, void *v_cache, const int64_t *slots, int width, int kv_f16,
                      int t0, int t1) {
    const size_t row_bytes = (size_t)width * (kv_f16 ? 2 : 4);
    for (int t = t0; t < t1; t++) {
        if (slots[t] < 0) continue;
        store_row(k + t * k_stride, (char *)k_cache + slots[t] * row_bytes, width, kv_f16);
        store_row(v + t * v_stride, (char *)v_cache + slots[t] * row_bytes, width, kv_f16);
    }
}

/* k, v [T, width] rows (strides given) into the caches' rows `slots[t]` (width elements each,
   float32 or float16 per `kv_f16`); a negative slot is padding and is skipped. */
int di_store_kv(const float *k, long k_stride, const float *v, long v_stride, void *k_cache,
                void *v_cache, long num_slots, const int64_t *slots, int T, int width,
                int kv_f16) {
    if (di_store_kv_check(num_slots, slots, T, width) != 0) return -1;
    di_store_kv_rows(k, k_stride, v, v_stride, k_cache, v_cache, slots, width, kv_f16, 0, T);
    return 0;
}

void di_silu_mul_rows(const float *gu, long gu_stride, float *out, long out_stride, int I, int t0,
                      int t1) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int t = t0; t < t1; t++) {
        const float *g = gu + t * gu_stride, *u = g + I;
        float *o = out + t * out_stride;
        for (int i = 0; i < I; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
}

/* gelu_tanh(x) = x / 2 (1 + tanh(y)), y = sqrt(2 / pi) (x + 0.044715 x^3), computed as the equal
   x / (1 + exp(-2 y)): torch's float32 formula loses the small results of negative x to the
   cancellation in 1 + tanh(y) (errors of up to ~2 ulps of x), this one does not; the two
   differ by at most ~3 ulps of x. Past exp8's range (-2 y above 88.3: x below about -10) the
   result is -0, as torch's is wherever its tanh rounds to -1 (x below about -5). */
static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 minus_2c = _mm256_set1_ps(-2.0f * 0.7978845608028654f);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube));
    const __m256 t = _mm256_mul_ps(minus_2c, inner);
    const __m256 over = _mm256_cmp_ps(t, _mm256_set1_ps(88.3f), _CMP_GT_OQ); /* exp8's top */
    const __m256 e = _mm256_blendv_ps(exp8(t), _mm256_set1_ps(INFINITY), over);
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

void di_gelu_tanh_mul_rows(const float *gu, long gu_stride, float *out, long out_stride, int I,
                           int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        const float *g = gu + t * gu_stride, *u = g + I;
        float *o = out + t * out_stride;
        for (int i = 0; i < I; i += 8) {
            const __m256 gelu = gelu_tanh8(_mm256_loadu_ps(g + i));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
        }
    }
}

int di_gated_mul_parallel(int T, int I) { return (long)T * I >= PARALLEL_MIN_ELEMENTS; }

typedef void gated_rows_fn(const float *gu, long gu_stride, float *out, long out_stride, int I,
                           int t0, int t1);

static int gated_mul(gated_rows_fn *rows, const float *gu, long gu_stride, float *out,
                     long out_stride, int T, int I, int num_threads) {
    if (T < 0 || I <= 0 || I % 8 != 0) return -1;
    const int threads = di_gated_mul_parallel(T, I) && num_threads > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < T; t++) rows(gu, gu_stride, out, out_stride, I, t, t + 1);
    return 0;
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(g) = g / (1 + exp(-g)): the MLP's gate and up
   halves of one fused projection (row stride given). I must be a multiple of 8. */
int di_silu_mul(const float *gu, long gu_stride, float *out, long out_stride, int T, int I,
                int num_threads) {
    return gated_mul(di_silu_mul_rows, gu, gu_stride, out, out_stride, T, I, num_threads);
}

/* out[t, i] = gelu_tanh(gu[t, i]) * gu[t, I + i] (gelu_tanh8 above), as di_silu_mul. */
int di_gelu_tanh_mul(const float *gu, long gu_stride, float *out, long out_stride, int T, int I,
                     int num_threads) {
    return gated_mul(di_gelu_tanh_mul_rows, gu, gu_stride, out, out_stride, T, I, num_threads);
}
