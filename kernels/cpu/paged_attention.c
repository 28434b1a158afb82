/* Paged decode attention on x86-64 CPUs with AVX2 and FMA: one query per request, read straight
   from the paged KV cache (no gathered copy of K/V, unlike the torch path).

   Caches are [num_blocks, block_size, Hkv, D] float32 or float16 (`kv_f16`; converted to float32
   as they are loaded, F16C), contiguous; a request's key p sits in
   block block_tables[b][p / block_size] at offset p % block_size. One task per (request, KV head)
   (OpenMP, dynamic: contexts differ): its G = H / Hkv query heads share every key and value
   row, each read once. Pass 1: scores of the G heads for every key, into a per-task buffer.
   Softmax with the vectorized exp of simd.h. Pass 2: the weighted sum of value rows.
   D must be a multiple of 16 and at most 256; G at most 16.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "deepinfer_kernels.h"
#include "simd.h"

#define MAX_D DI_MAX_HEAD_DIM
#define MAX_G DI_MAX_GROUP

/* Eight cache elements from index `i` as float32: F16 is a compile-time constant in every
   caller (always inlined), so each instantiation has one kind of load. */
static inline __attribute__((always_inline)) __m256 load8(const void *cache, long i, const int F16) {
    return F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i)))
               : _mm256_loadu_ps((const float *)cache + i);
}

/* Four dot products of D floats each (a0..a3) summed into one vector [s0, s1, s2, s3]. */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* scores[g * L + p] = scale * q_g . k_p for the G heads of one KV head. NV = D / 8 is a
   compile-time constant in each instantiation (always inlined), so the loops over D unroll. */
static inline __attribute__((always_inline)) void scores_impl(
    const float *q, long q_stride_h, int G, const void *k_cache, const int32_t *table, int L,
    int S, long row, long head_off, float scale, float *scores, const int NV, const int F16) {
    for (int g = 0; g < G; g++) {
        __m256 qv[MAX_D / 8];
        for (int i = 0; i < NV; i++)
            qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + g * q_stride_h + 8 * i), _mm256_set1_ps(scale));
        float *sg = scores + (long)g * L;
        for (int p0 = 0; p0 < L; p0 += S) {
            const long k = (long)table[p0 / S] * S * row + head_off; /* element index */
            const int n = L - p0 < S ? L - p0 : S;
            int j = 0;
            for (; j + 4 <= n; j += 4) {
                const long k0 = k + j * row, k1 = k0 + row, k2 = k1 + row, k3 = k2 + row;
                __m256 a0 = _mm256_mul_ps(qv[0], load8(k_cache, k0, F16));
                __m256 a1 = _mm256_mul_ps(qv[0], load8(k_cache, k1, F16));
                __m256 a2 = _mm256_mul_ps(qv[0], load8(k_cache, k2, F16));
                __m256 a3 = _mm256_mul_ps(qv[0], load8(k_cache, k3, F16));
                for (int i = 1; i < NV; i++) {
                    a0 = _mm256_fmadd_ps(qv[i], load8(k_cache, k0 + 8 * i, F16), a0);
                    a1 = _mm256_fmadd_ps(qv[i], load8(k_cache, k1 + 8 * i, F16), a1);
                    a2 = _mm256_fmadd_ps(qv[i], load8(k_cache, k2 + 8 * i, F16), a2);
                    a3 = _mm256_fmadd_ps(qv[i], load8(k_cache, k3 + 8 * i, F16), a3);
                }
                _mm_storeu_ps(sg + p0 + j, hsum4x8(a0, a1, a2, a3));
            }
            for (; j < n; j++) {
                const long kj = k + j * row;
                __m256 a = _mm256_mul_ps(qv[0], load8(k_cache, kj, F16));
                for (int i = 1; i < NV; i++) a = _mm256_fmadd_ps(qv[i], load8(k_cache, kj + 8 * i, F16), a);
                sg[p0 + j] = hsum8(a);
            }
        }
    }
}

static void scores_pass(const float *q, long q_stride_h, int G, const void *k_cache,
                        const int32_t *table, int L, int S, int Hkv, int kvh, int D, float scale,
                        float *scores, int f16) {
    const long row = (long)Hkv * D, off = (long)kvh * D;
#define SCORES(NV, F16) scores_impl(q, q_stride_h, G, k_cache, table, L, S, row, off, scale, scores, NV, F16)
    if (f16) {
        switch (D) {
            case 64: SCORES(8, 1); break;
            case 128: SCORES(16, 1); break;
            default: SCORES(D / 8, 1);
        }
    } else {
        switch (D) {
            case 64: SCORES(8, 0); break;
            case 128: SCORES(16, 0); break;
            default: SCORES(D / 8, 0);
        }
    }
#undef SCORES
}

/* In place: scores of one head -> softmax weights (divided by their sum). */
static void softmax(float *s, int L) {
    float mx = -INFINITY;
    for (int p = 0; p < L; p++) mx = s[p] > mx ? s[p] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int p = 0;
    for (; p + 8 <= L; p += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmx));
        _mm256_storeu_ps(s + p, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    for (; p < L; p++) {
        s[p] = expf(s[p] - mx);
        sum += s[p];
    }
    const float inv = 1.0f / sum;
    for (p = 0; p < L; p++) s[p] *= inv;
}

/* out_g[c:c+16] = sum_p w[g * L + p] * v_p[c:c+16] for G heads at once (G a compile-time
   constant in each instantiation: 2G accumulators and G weights stay in registers). */
static inline __attribute__((always_inline)) void values_impl(
    const float *w, const void *v_cache, const int32_t *table, int L, int S, long row,
    long head_off, int D, float *out, long out_stride_h, const int G, const int F16) {
    for (int c = 0; c < D; c += 16) {
        __m256 lo[MAX_G], hi[MAX_G];
        for (int g = 0; g < G; g++) lo[g] = hi[g] = _mm256_setzero_ps();
        for (int p0 = 0; p0 < L; p0 += S) {
            const long v = (long)table[p0 / S] * S * row + head_off + c; /* element index */
            const int n = L - p0 < S ? L - p0 : S;
            for (int j = 0; j < n; j++) {
                const __m256 v0 = load8(v_cache, v + j * row, F16);
                const __m256 v1 = load8(v_cache, v + j * row + 8, F16);
                for (int g = 0; g < G; g++) {
                    const __m256 wg = _mm256_broadcast_ss(w + (long)g * L + p0 + j);
                    lo[g] = _mm256_fmadd_ps(wg, v0, lo[g]);
                    hi[g] = _mm256_fmadd_ps(wg, v1, hi[g]);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            _mm256_storeu_ps(out + g * out_stride_h + c, lo[g]);
            _mm256_storeu_ps(out + g * out_stride_h + c + 8, hi[g]);
        }
    }
}

static void values_pass(const float *w, int G, const void *v_cache, const int32_t *table, int L,
                        int S, int Hkv, int kvh, int D, float *out, long out_stride_h, int f16) {
    const long row = (long)Hkv * D, off = (long)kvh * D;
#define VALUES(g, F16) values_impl(w, v_cache, table, L, S, row, off, D, out, out_stride_h, g, F16)
#define VALUES_CASE(n, F16) case n: VALUES(n, F16); break;
    if (f16) {
        switch (G) {
            VALUES_CASE(1, 1) VALUES_CASE(2, 1) VALUES_CASE(3, 1) VALUES_CASE(4, 1)
            VALUES_CASE(5, 1) VALUES_CASE(6, 1) VALUES_CASE(7, 1) VALUES_CASE(8, 1)
            default: VALUES(G, 1);
        }
    } else {
        switch (G) {
            VALUES_CASE(1, 0) VALUES_CASE(2, 0) VALUES_CASE(3, 0) VALUES_CASE(4, 0)
            VALUES_CASE(5, 0) VALUES_CASE(6, 0) VALUES_CASE(7, 0) VALUES_CASE(8, 0)
            default: VALUES(G, 0);
        }
    }
#undef VALUES_CASE
#undef VALUES
}

/* See di_attention_args in deepinfer_kernels.h. */
int di_paged_decode_attention(const di_attention_args *a) {
    const int B = a->B, H = a->H, Hkv = a->Hkv, D = a->D, S = a->S, max_blocks = a->max_blocks;
    if (B < 0 || Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_G || D % 16 != 0 || D > MAX_D ||
        D <= 0 || S <= 0) {
        return -1;
    }
    const int32_t *context_lens = a->context_lens;
    for (int b = 0; b < B; b++) {
        if (context_lens[b] <= 0 || context_lens[b] > max_blocks * S) return -1;
    }
    const float *q = a->q;
    const float scale = a->scale;
    const long q_stride_b = a->q_stride_b, q_stride_h = a->q_stride_h;
    const void *k_cache = a->k_cache, *v_cache = a->v_cache;
    const int32_t *block_tables = a->block_tables;
    float *out = a->out;
    const int num_threads = a->num_threads, kv_f16 = a->kv_f16;
    const int G = H / Hkv;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads > 0 ? num_threads : 1)
    for (int task = 0; task < B * Hkv; task++) {
        const int b = task / Hkv, kvh = task % Hkv;
        const int L = context_lens[b];
        float *scores = malloc(sizeof(float) * (size_t)G * L);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const int32_t *table = block_tables + (long)b * max_blocks;
        const float *qh = q + b * q_stride_b + (long)kvh * G * q_stride_h;
        scores_pass(qh, q_stride_h, G, k_cache, table, L, S, Hkv, kvh, D, scale, scores, kv_f16);
        for (int g = 0; g < G; g++) softmax(scores + (long)g * L, L);
        values_pass(scores, G, v_cache, table, L, S, Hkv, kvh, D,
                    out + ((long)b * H + (long)kvh * G) * D, D, kv_f16);
        free(scores);
    }
    return failed ? -2 : 0;
}
