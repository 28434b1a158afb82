/* Paged decode attention on x86-64 CPUs with AVX2 and FMA: one query per request, read straight
   from the paged KV cache (no gathered copy of K/V, unlike the torch path).

   Caches are [num_blocks, block_size, Hkv, D] float32 or float16 (`kv_f16`; converted to float32
   as they are loaded, F16C), contiguous; a request's key p sits in
   block block_tables[b][p / block_size] at offset p % block_size.

   Split by context (flash-decoding): a task is one request's run of `chunk_keys(S)` consecutive
   keys (a fixed count, a multiple of the block size) for every head, so a task reads whole
   cache rows, each once, and one request's keys spread over every thread: a lone stream's
   3 KV heads no longer leave one of two threads idle for a third of the time. A task first asks
   for its rows (software prefetch: the keys into L1, the values into L2), then, for each KV head,
   scores its G = H / Hkv query heads against every key of the run (pass 1), takes the run's
   maximum m and the exponentials' sum l (with the vectorized exp of simd.h), and sums the value
   rows weighted by the unnormalized exponentials (pass 2). The runs of a request are then merged
   in order: out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, with M the largest m_c.
   The run length does not depend on the thread count or on the other requests, and neither
   does the merge: a request's output is the same bits whatever else is in the batch.
   D must be a multiple of 16 and at most 256; G at most 16.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "deepinfer_kernels.h"
#include "parts.h"
#include "simd.h"

#define MAX_D DI_MAX_HEAD_DIM
#define MAX_G DI_MAX_GROUP
/* Keys of one task, rounded to whole blocks (see chunk_keys). */
#define CHUNK_KEYS 64

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
    int skip, int S, long row, long head_off, float scale, float *scores, const int NV,
    const int F16) {
    for (int g = 0; g < G; g++) {
        __m256 qv[MAX_D / 8];
        for (int i = 0; i < NV; i++)
            qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + g * q_stride_h + 8 * i), _mm256_set1_ps(scale));
        float *sg = scores + (long)g * L;
        for (int p0 = 0; p0 < L; p0 += S) {
            const long k = (long)table[p0 / S] * S * row + head_off; /* element index */
            const int n = L - p0 < S ? L - p0 : S;
            int j = p0 == 0 ? skip : 0; /* keys before a window are not read */
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
                        const int32_t *table, int L, int skip, int S, int Hkv, int kvh, int D,
                        float scale, float *scores, int f16) {
    const long row = (long)Hkv * D, off = (long)kvh * D;
#define SCORES(NV, F16) scores_impl(q, q_stride_h, G, k_cache, table, L, skip, S, row, off, scale, scores, NV, F16)
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

/* In place: scores of one head over a run of keys -> exp(s - m), with m their maximum;
   returns m and the exponentials' sum in *m_out, *l_out. */
static void partial_softmax(float *s, int L, float *m_out, float *l_out) {
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
    *m_out = mx;
    *l_out = sum;
}

/* out_g[c:c+16] = sum_p w[g * L + p] * v_p[c:c+16] for G heads at once (G a compile-time
   constant in each instantiation: 2G accumulators and G weights stay in registers). */
static inline __attribute__((always_inline)) void values_impl(
    const float *w, const void *v_cache, const int32_t *table, int L, int skip, int S, long row,
    long head_off, int D, float *out, long out_stride_h, const int G, const int F16) {
    for (int c = 0; c < D; c += 16) {
        __m256 lo[MAX_G], hi[MAX_G];
        for (int g = 0; g < G; g++) lo[g] = hi[g] = _mm256_setzero_ps();
        for (int p0 = 0; p0 < L; p0 += S) {
            const long v = (long)table[p0 / S] * S * row + head_off + c; /* element index */
            const int n = L - p0 < S ? L - p0 : S;
            for (int j = p0 == 0 ? skip : 0; j < n; j++) {
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
                        int skip, int S, int Hkv, int kvh, int D, float *out, long out_stride_h,
                        int f16) {
    const long row = (long)Hkv * D, off = (long)kvh * D;
#define VALUES(g, F16) values_impl(w, v_cache, table, L, skip, S, row, off, D, out, out_stride_h, g, F16)
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

/* Keys a task covers: CHUNK_KEYS rounded down to whole blocks (one block when larger). */
static inline int chunk_keys(int S) { return S >= CHUNK_KEYS ? S : CHUNK_KEYS / S * S; }

/* Ask for the cache rows of keys [0, L) of a run starting at block table[0]: `bytes` a row. */
static void prefetch_rows(const void *cache, const int32_t *table, int L, int S, long bytes,
                          int hint_l1) {
    for (int p0 = 0; p0 < L; p0 += S) {
        const int n = L - p0 < S ? L - p0 : S;
        const char *start = (const char *)cache + (long)table[p0 / S] * S * bytes;
        for (long o = 0; o < n * bytes; o += 64) {
            if (hint_l1) {
                _mm_prefetch(start + o, _MM_HINT_T0);
            } else {
                _mm_prefetch(start + o, _MM_HINT_T1);
            }
        }
    }
}

/* One task: keys [k0, k0 + L) of request b for all H heads, k0 a multiple of S, the first
   `skip` of them (fewer than S) before the query's window: never read, scored -inf. Writes the
   unnormalized outputs part[H * D] and each head's maximum and sum stats[2 * h],
   stats[2 * h + 1]; `scores` has room for G * L floats. */
static void run_task(const di_attention_args *a, int b, int k0, int L, int skip, float *part,
                     float *stats, float *scores) {
    const int Hkv = a->Hkv, D = a->D, S = a->S, G = a->H / a->Hkv, f16 = a->kv_f16;
    const int32_t *table = a->block_tables + (long)b * a->max_blocks + k0 / S;
    const long row_bytes = (long)Hkv * D * (f16 ? 2 : 4);
    prefetch_rows(a->k_cache, table, L, S, row_bytes, 1);
    prefetch_rows(a->v_cache, table, L, S, row_bytes, 0);
    for (int kvh = 0; kvh < Hkv; kvh++) {
        const float *qh = a->q + b * a->q_stride_b + (long)kvh * G * a->q_stride_h;
        scores_pass(qh, a->q_stride_h, G, a->k_cache, table, L, skip, S, Hkv, kvh, D, a->scale,
                    scores, f16);
        for (int g = 0; g < G; g++) {
            float *st = stats + 2 * (kvh * G + g);
            for (int p = 0; p < skip; p++) scores[(long)g * L + p] = -INFINITY;
            partial_softmax(scores + (long)g * L, L, st, st + 1);
        }
        values_pass(scores, G, a->v_cache, table, L, skip, S, Hkv, kvh, D,
                    part + (long)kvh * G * D, D, f16);
    }
}

/* out[h] of one request from its n runs (parts [n][H * D], stats [n][2 * H]), in run order. */
static void merge_runs(const float *parts, const float *stats, int n, int H, int D, float *out) {
    for (int h = 0; h < H; h++) {
        float mx = -INFINITY;
        for (int c = 0; c < n; c++) mx = fmaxf(mx, stats[(long)c * 2 * H + 2 * h]);
        float l = 0.0f;
        for (int d = 0; d < D; d++) out[(long)h * D + d] = 0.0f;
        for (int c = 0; c < n; c++) {
            const float *st = stats + (long)c * 2 * H + 2 * h;
            const float w = expf(st[0] - mx);
            l += w * st[1];
            const __m256 vw = _mm256_set1_ps(w);
            const float *o = parts + (long)c * H * D + (long)h * D;
            for (int d = 0; d < D; d += 8) {
                const __m256 acc = _mm256_loadu_ps(out + (long)h * D + d);
                _mm256_storeu_ps(out + (long)h * D + d,
                                 _mm256_fmadd_ps(vw, _mm256_loadu_ps(o + d), acc));
            }
        }
        const __m256 inv = _mm256_set1_ps(1.0f / l);
        for (int d = 0; d < D; d += 8) {
            _mm256_storeu_ps(out + (long)h * D + d,
                             _mm256_mul_ps(_mm256_loadu_ps(out + (long)h * D + d), inv));
        }
    }
}

/* The first key request b's query attends to (its window's first). */
static inline int first_key(const di_attention_args *a, int b) {
    const int n = a->context_lens[b];
    return a->window > 0 && n > a->window ? n - a->window : 0;
}

int di_attention_check(const di_attention_args *a) {
    const int H = a->H, Hkv = a->Hkv, D = a->D;
    if (a->B < 0 || Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_G || D % 16 != 0 || D > MAX_D ||
        D <= 0 || a->S <= 0 || a->window < 0) {
        return -1;
    }
    for (int b = 0; b < a->B; b++) {
        const int32_t n = a->context_lens[b];
        if (n <= 0 || n > a->max_blocks * a->S) return -1;
    }
    return 0;
}

void di_attention_plan_free(di_attention_plan *p) {
    free(p->first);
    free(p->task_b);
    free(p->parts);
    free(p->stats);
    free(p->scores);
    p->first = p->task_b = NULL;
    p->parts = p->stats = p->scores = NULL;
}

int di_attention_plan_init(di_attention_plan *p, const di_attention_args *a, int max_threads) {
    const int B = a->B, H = a->H, D = a->D, C = chunk_keys(a->S);
    *p = (di_attention_plan){0};
    atomic_init(&p->next_task, 0);
    p->chunk = C;
    p->first = malloc(sizeof(int) * ((size_t)B + 1));
    if (p->first == NULL) return -2;
    p->first[0] = 0;
    /* the runs of C keys (from key 0, whatever the window) that hold a key of the window */
    for (int b = 0; b < B; b++) {
        p->first[b + 1] = p->first[b] + (a->context_lens[b] + C - 1) / C - first_key(a, b) / C;
    }
    p->num_tasks = p->first[B];
    const size_t tasks = (size_t)p->num_tasks > 0 ? (size_t)p->num_tasks : 1;
    p->task_b = malloc(sizeof(int) * tasks);
    p->parts = malloc(sizeof(float) * tasks * H * D);
    p->stats = malloc(sizeof(float) * tasks * 2 * H);
    p->scores = malloc(sizeof(float) * (size_t)max_threads * (H / a->Hkv) * C);
    if (p->task_b == NULL || p->parts == NULL || p->stats == NULL || p->scores == NULL) {
        di_attention_plan_free(p);
        return -2;
    }
    for (int b = 0; b < B; b++) {
        for (int t = p->first[b]; t < p->first[b + 1]; t++) p->task_b[t] = b;
    }
    return 0;
}

void di_attention_team(const di_attention_args *a, di_attention_plan *p, di_team *team) {
    const int H = a->H, D = a->D, C = p->chunk;
    float *scores = p->scores + (long)team->ith * (H / a->Hkv) * C;
    /* tasks claimed one at a time: contexts differ */
    for (;;) {
        const int t = atomic_fetch_add_explicit(&p->next_task, 1, memory_order_relaxed);
        if (t >= p->num_tasks) break;
        const int b = p->task_b[t], from = first_key(a, b);
        const int run = (from / C + t - p->first[b]) * C, end = run + C;
        const int k0 = from > run ? from / a->S * a->S : run; /* the window's first block on */
        const int L = (a->context_lens[b] < end ? a->context_lens[b] : end) - k0;
        run_task(a, b, k0, L, from > k0 ? from - k0 : 0, p->parts + (long)t * H * D,
                 p->stats + (long)t * 2 * H, scores);
    }
    di_team_sync(team);
    if (team->ith == 0) atomic_store_explicit(&p->next_task, 0, memory_order_relaxed);
    int b0, b1;
    di_team_range(team, a->B, &b0, &b1);
    for (int b = b0; b < b1; b++) {
        merge_runs(p->parts + (long)p->first[b] * H * D, p->stats + (long)p->first[b] * 2 * H,
                   p->first[b + 1] - p->first[b], H, D, a->out + (long)b * H * D);
    }
}

/* See di_attention_args in deepinfer_kernels.h. */
int di_paged_decode_attention(const di_attention_args *a) {
    if (di_attention_check(a) != 0) return -1;
    if (a->B == 0) return 0;
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
    di_attention_plan plan;
    if (di_attention_plan_init(&plan, a, threads) != 0) return -2;
    di_barrier barrier;
    di_barrier_init(&barrier);
#pragma omp parallel num_threads(threads)
    {
        di_team team = di_team_join(&barrier);
        di_attention_team(a, &plan, &team);
    }
    di_attention_plan_free(&plan);
    return 0;
}
