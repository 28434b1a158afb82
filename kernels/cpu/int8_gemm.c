/* Integer-dot-product matmuls over GGUF Q4_1 / Q8_0 weights on x86-64 with AVX2 and FMA; the
   K-quants' packing and passes are cpu/int8_kquants.c's, driven from here as these are.

   y[M, N] = x[M, K] @ W[N, K]^T, as llama.cpp computes it on CPU: each row of x is quantized to
   int8 in blocks of 32 (scale dx = max|x| / 127, q = round(x / dx), and sx = dx * sum(q)), and each
   32-long piece of a dot product is an integer sum, scaled once:
     Q4_1 (w = d*q + m):  dot = d * dx * sum(q_w * q_x) + m * sx
     Q8_0 (w = d*q):      dot = d * dx * sum(q_w * q_x)
   `vpmaddubsw` multiplies 32 unsigned by 32 signed bytes a cycle, against 8 float FMAs.

   Weights are repacked once (`di_int8_pack`) into groups of 8 rows, block by block:
     Q4_1 group block (160 bytes): 4 x 32 bytes of nibbles, then d[8], m[8] as float16.
       Byte 4r+i of 32-byte chunk j holds row r's weight 4j+i in its low nibble and 16+4j+i in
       its high nibble (j = 0..3, i = 0..3): one load and a mask give 4 weights of each of the 8
       rows, ready to multiply by 4 broadcast bytes of x.
     Q8_0 group block (272 bytes): 8 x 32 bytes (chunk j: row r's weights 4j..4j+3 at 4r), d[8]
       as float16.
   The scales stay GGUF's float16 (widened by one `vcvtph2ps`): the packed weight is as many bytes
   as the GGUF blocks, and a one-row product, which streams every weight once, is bound by how
   fast a core reads them.
   Rows past N (the last group) are zero. A lane of every vector is one output: no horizontal
   sums, and each output's arithmetic is the same whatever M is or how rows were grouped.

   Q4_1 products fit int16 summed over a whole block (8 x 2 x 15 x 127 = 30480): one `vpmaddwd`
   a block. Q8_0 products do not (2 x 127 x 127 = 32258 each): it widens after every multiply.

   Where the CPU has AVX-512 VNNI (`di_int8_isa`), `vpdpbusd` does the multiply, the pair sums and
   the int32 accumulation in one instruction, and the 32 vector registers of AVX-512 hold a pass
   over a group for 8 rows of x instead of 4: a row costs under half the instructions, which is
   what several rows (a batch, or a decode row and its drafts) are bound by. The integer sums are
   exact either way and the float steps the same, so both give the same bits.
*/
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "deepinfer_kernels.h"
#include "int8.h"
#include "parts.h"

#define QK DI_QK

enum { FMT_Q4_1 = DI_FMT_Q4_1, FMT_Q8_0 = DI_FMT_Q8_0 };

static inline int is_kquant(int fmt) { return di_block_weights(fmt) == DI_QK_K; }

/* Bytes of a Q4_1 or Q8_0 group block (8 rows of one block of 32) */
static inline size_t group_block_bytes(int fmt) { return fmt == FMT_Q4_1 ? 160 : 272; }

/* Bytes of one packed group of 8 rows of K weights */
static inline size_t group_bytes(int fmt, int K) {
    if (is_kquant(fmt)) return (size_t)di_int8_kquant_group_bytes(fmt, K);
    return (size_t)(K / QK) * group_block_bytes(fmt);
}

/* Bytes of the packed weight; 0 for bad arguments. */
long di_int8_packed_bytes(int fmt, int N, int K) {
    if (!di_format_ok(fmt, K) || N <= 0) return 0;
    const long groups = (N + GROUP - 1) / GROUP;
    return groups * (long)group_bytes(fmt, K);
}

static void pack_group_q4_1(const uint8_t *w, int rows, int nb, uint8_t *out) {
    const size_t rb = (size_t)nb * 20;
    for (int b = 0; b < nb; b++, out += 160) {
        memset(out, 0, 160);
        for (int r = 0; r < rows; r++) {
            const uint8_t *blk = w + r * rb + (size_t)b * 20;
            memcpy(out + 128 + 2 * r, blk, 2);     /* d */
            memcpy(out + 144 + 2 * r, blk + 2, 2); /* m */
            /* qs[k] holds weight k (low nibble) and weight 16 + k (high): the layout wanted */
            for (int j = 0; j < 4; j++) memcpy(out + 32 * j + 4 * r, blk + 4 + 4 * j, 4);
        }
    }
}

static void pack_group_q8_0(const uint8_t *w, int rows, int nb, uint8_t *out) {
    const size_t rb = (size_t)nb * 34;
    for (int b = 0; b < nb; b++, out += 272) {
        memset(out, 0, 272);
        for (int r = 0; r < rows; r++) {
            const uint8_t *blk = w + r * rb + (size_t)b * 34;
            memcpy(out + 256 + 2 * r, blk, 2); /* d */
            for (int j = 0; j < 8; j++) memcpy(out + 32 * j + 4 * r, blk + 2 + 4 * j, 4);
        }
    }
}

/* Repack N rows of GGUF blocks (rows of K weights) into `out` (di_int8_packed_bytes). */
int di_int8_pack(int fmt, const uint8_t *w, uint8_t *out, int N, int K, int num_threads) {
    if (di_int8_packed_bytes(fmt, N, K) == 0) return -1;
    const int nb = K / QK, groups = (N + GROUP - 1) / GROUP;
    const size_t rb = di_row_bytes(fmt, K), gb = group_bytes(fmt, K);
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int g = 0; g < groups; g++) {
        const int rows = N - g * GROUP < GROUP ? N - g * GROUP : GROUP;
        const uint8_t *src = w + (size_t)g * GROUP * rb;
        if (fmt == FMT_Q4_1) {
            pack_group_q4_1(src, rows, nb, out + g * gb);
        } else if (fmt == FMT_Q8_0) {
            pack_group_q8_0(src, rows, nb, out + g * gb);
        } else {
            di_int8_kquant_pack(fmt, src, rows, K, out + g * gb);
        }
    }
    return 0;
}

/* One row of x to int8 blocks: q[K], dx[nb], sx[nb] (sx = dx * sum(q)). Rounds half to even. */
static void quantize_row(const float *x, int K, int8_t *q, float *dx, float *sx) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
        }
        __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        a = _mm_max_ps(a, _mm_movehl_ps(a, a));
        a = _mm_max_ss(a, _mm_movehdup_ps(a));
        const float max_abs = _mm_cvtss_f32(a);
        const float d = max_abs / 127.0f;
        const float inv = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i sum = _mm256_setzero_si256();
        __m256i qi[4];
        for (int i = 0; i < 4; i++) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vinv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            qi[i] = _mm256_cvtps_epi32(r);
            sum = _mm256_add_epi32(sum, qi[i]);
        }
        /* int32 -> int8, in order: packs interleave 128-bit lanes, the permute restores it */
        const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
        const __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), p);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s = _mm_hadd_epi32(s, s);
        s = _mm_hadd_epi32(s, s);
        dx[b] = d;
        sx[b] = d * (float)_mm_cvtsi128_si32(s);
    }
}

/* One group of 8 weight rows times R quantized rows of x (R a constant, so the accumulators
   stay in registers): acc[c] lane r = y[c, r], which the pass continues (the caller sets it to
   zero, or to a sum over earlier K to go on with). `q` rows are K apart, `dx`/`sx` rows K/32. */
#define GROUP_Q4_1(R)                                                                          \
    static void group_q4_1_x##R(const uint8_t *g, int nb, const int8_t *q, const float *dx,     \
                                const float *sx, int K, int pf, __m256 *acc) {                  \
        const __m256i low = _mm256_set1_epi8(0x0F);                                             \
        const __m256i ones = _mm256_set1_epi16(1);                                              \
        __m256 a[R];                                                                            \
        for (int c = 0; c < R; c++) a[c] = acc[c];                                              \
        for (int b = 0; b < nb; b++, g += 160) {                                                \
            if (pf) prefetch_block(g, 160);                                                     \
            __m256i s16[R];                                                                     \
            for (int c = 0; c < R; c++) s16[c] = _mm256_setzero_si256();                        \
            const int8_t *qb = q + b * QK;                                                      \
            _Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {                               \
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + 32 * j));          \
                const __m256i lo = _mm256_and_si256(raw, low);                                  \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);            \
                for (int c = 0; c < R; c++) {                                                   \
                    const int8_t *qc = qb + (size_t)c * K;                                      \
                    s16[c] = _mm256_add_epi16(s16[c], _mm256_maddubs_epi16(lo, bcast4(qc + 4 * j))); \
                    s16[c] = _mm256_add_epi16(                                                  \
                        s16[c], _mm256_maddubs_epi16(hi, bcast4(qc + 16 + 4 * j)));             \
                }                                                                               \
            }                                                                                   \
            const __m256 d = scales8(g + 128);                                                  \
            const __m256 m = scales8(g + 144);                                                  \
            for (int c = 0; c < R; c++) {                                                       \
                const size_t at = (size_t)c * nb + b;                                           \
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[c], ones));         \
                a[c] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[at])), a[c]);    \
                a[c] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[at]), a[c]);                        \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < R; c++) acc[c] = a[c];                                              \
    }

#define GROUP_Q8_0(R)                                                                          \
    static void group_q8_0_x##R(const uint8_t *g, int nb, const int8_t *q, const float *dx,     \
                                const float *sx, int K, int pf, __m256 *acc) {                  \
        (void)sx;                                                                               \
        const __m256i ones = _mm256_set1_epi16(1);                                              \
        __m256 a[R];                                                                            \
        for (int c = 0; c < R; c++) a[c] = acc[c];                                              \
        for (int b = 0; b < nb; b++, g += 272) {                                                \
            if (pf) prefetch_block(g, 272);                                                     \
            __m256i s32[R];                                                                     \
            for (int c = 0; c < R; c++) s32[c] = _mm256_setzero_si256();                        \
            const int8_t *qb = q + b * QK;                                                      \
            _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {                               \
                const __m256i w = _mm256_loadu_si256((const __m256i *)(g + 32 * j));            \
                const __m256i aw = _mm256_sign_epi8(w, w);                                      \
                for (int c = 0; c < R; c++) {                                                   \
                    const __m256i xs = _mm256_sign_epi8(bcast4(qb + (size_t)c * K + 4 * j), w); \
                    s32[c] = _mm256_add_epi32(                                                  \
                        s32[c], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));         \
                }                                                                               \
            }                                                                                   \
            const __m256 d = scales8(g + 256);                                                  \
            for (int c = 0; c < R; c++) {                                                       \
                const size_t at = (size_t)c * nb + b;                                           \
                a[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[c]),                              \
                                       _mm256_mul_ps(d, _mm256_set1_ps(dx[at])), a[c]);         \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < R; c++) acc[c] = a[c];                                              \
    }

GROUP_Q4_1(1)
GROUP_Q4_1(2)
GROUP_Q4_1(3)
GROUP_Q4_1(4)
GROUP_Q8_0(1)
GROUP_Q8_0(2)
GROUP_Q8_0(3)
GROUP_Q8_0(4)

static const group_fn GROUP_FNS[2][MR] = {
    {group_q4_1_x1, group_q4_1_x2, group_q4_1_x3, group_q4_1_x4},
    {group_q8_0_x1, group_q8_0_x2, group_q8_0_x3, group_q8_0_x4},
};

/* The same passes with `vpdpbusd` (AVX-512 VNNI, on 256-bit vectors), for up to MR_VNNI rows:
   the low and high nibbles (Q4_1), or the even and odd chunks (Q8_0), sum into two int32
   accumulators a row, so a one-row pass is not one chain of dependent instructions. */
#define GROUP_Q4_1_VNNI(R)                                                                     \
    VNNI static void group_q4_1_vnni_x##R(const uint8_t *g, int nb, const int8_t *q,           \
                                          const float *dx, const float *sx, int K, int pf,      \
                                          __m256 *acc) {                                        \
        const __m256i low = _mm256_set1_epi8(0x0F);                                             \
        __m256 a[R];                                                                            \
        for (int c = 0; c < R; c++) a[c] = acc[c];                                              \
        for (int b = 0; b < nb; b++, g += 160) {                                                \
            if (pf) prefetch_block(g, 160);                                                     \
            __m256i s_lo[R], s_hi[R];                                                           \
            for (int c = 0; c < R; c++) s_lo[c] = s_hi[c] = _mm256_setzero_si256();             \
            const int8_t *qb = q + b * QK;                                                      \
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                               \
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + 32 * j));          \
                const __m256i lo = _mm256_and_si256(raw, low);                                  \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);            \
                for (int c = 0; c < R; c++) {                                                   \
                    const int8_t *qc = qb + (size_t)c * K;                                      \
                    s_lo[c] = _mm256_dpbusd_epi32(s_lo[c], lo, bcast4(qc + 4 * j));             \
                    s_hi[c] = _mm256_dpbusd_epi32(s_hi[c], hi, bcast4(qc + 16 + 4 * j));        \
                }                                                                               \
            }                                                                                   \
            const __m256 d = scales8(g + 128);                                                  \
            const __m256 m = scales8(g + 144);                                                  \
            for (int c = 0; c < R; c++) {                                                       \
                const size_t at = (size_t)c * nb + b;                                           \
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(s_lo[c], s_hi[c]));      \
                a[c] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[at])), a[c]);    \
                a[c] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[at]), a[c]);                        \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < R; c++) acc[c] = a[c];                                              \
    }

#define GROUP_Q8_0_VNNI(R)                                                                     \
    VNNI static void group_q8_0_vnni_x##R(const uint8_t *g, int nb, const int8_t *q,           \
                                          const float *dx, const float *sx, int K, int pf,      \
                                          __m256 *acc) {                                        \
        (void)sx;                                                                               \
        __m256 a[R];                                                                            \
        for (int c = 0; c < R; c++) a[c] = acc[c];                                              \
        for (int b = 0; b < nb; b++, g += 272) {                                                \
            if (pf) prefetch_block(g, 272);                                                     \
            __m256i s_even[R], s_odd[R];                                                        \
            for (int c = 0; c < R; c++) s_even[c] = s_odd[c] = _mm256_setzero_si256();          \
            const int8_t *qb = q + b * QK;                                                      \
            _Pragma("GCC unroll 4") for (int j = 0; j < 8; j += 2) {                            \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(g + 32 * j));           \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(g + 32 * j + 32));      \
                const __m256i aw0 = _mm256_sign_epi8(w0, w0);                                   \
                const __m256i aw1 = _mm256_sign_epi8(w1, w1);                                   \
                for (int c = 0; c < R; c++) {                                                   \
                    const int8_t *qc = qb + (size_t)c * K + 4 * j;                              \
                    s_even[c] = _mm256_dpbusd_epi32(s_even[c], aw0,                             \
                                                    _mm256_sign_epi8(bcast4(qc), w0));          \
                    s_odd[c] = _mm256_dpbusd_epi32(s_odd[c], aw1,                               \
                                                   _mm256_sign_epi8(bcast4(qc + 4), w1));       \
                }                                                                               \
            }                                                                                   \
            const __m256 d = scales8(g + 256);                                                  \
            for (int c = 0; c < R; c++) {                                                       \
                const size_t at = (size_t)c * nb + b;                                           \
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(s_even[c], s_odd[c]));   \
                a[c] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[at])), a[c]);    \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < R; c++) acc[c] = a[c];                                              \
    }

GROUP_Q4_1_VNNI(1)
GROUP_Q4_1_VNNI(2)
GROUP_Q4_1_VNNI(3)
GROUP_Q4_1_VNNI(4)
GROUP_Q4_1_VNNI(5)
GROUP_Q4_1_VNNI(6)
GROUP_Q4_1_VNNI(7)
GROUP_Q4_1_VNNI(8)
GROUP_Q8_0_VNNI(1)
GROUP_Q8_0_VNNI(2)
GROUP_Q8_0_VNNI(3)
GROUP_Q8_0_VNNI(4)
GROUP_Q8_0_VNNI(5)
GROUP_Q8_0_VNNI(6)
GROUP_Q8_0_VNNI(7)
GROUP_Q8_0_VNNI(8)

static const group_fn GROUP_FNS_VNNI[2][MR_VNNI] = {
    {group_q4_1_vnni_x1, group_q4_1_vnni_x2, group_q4_1_vnni_x3, group_q4_1_vnni_x4,
     group_q4_1_vnni_x5, group_q4_1_vnni_x6, group_q4_1_vnni_x7, group_q4_1_vnni_x8},
    {group_q8_0_vnni_x1, group_q8_0_vnni_x2, group_q8_0_vnni_x3, group_q8_0_vnni_x4,
     group_q8_0_vnni_x5, group_q8_0_vnni_x6, group_q8_0_vnni_x7, group_q8_0_vnni_x8},
};

static int cpu_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
}

/* 1 where the passes use VNNI: set when the library loads, and by di_int8_isa */
static int use_vnni = 0;

int di_int8_isa(int want) {
    if (want >= 0) use_vnni = want != 0 && cpu_has_vnni();
    return use_vnni;
}

__attribute__((constructor)) static void choose_isa(void) { di_int8_isa(1); }

/* The accumulators a pass starts from: zero, or (`accumulate`) y's rows as they are. */
static inline void load_group(__m256 *acc, int mr, const float *y, long ldy, int rows,
                              int accumulate) {
    for (int c = 0; c < mr; c++) {
        if (!accumulate) {
            acc[c] = _mm256_setzero_ps();
        } else if (rows == GROUP) {
            acc[c] = _mm256_loadu_ps(y + (size_t)c * ldy);
        } else {
            float tmp[GROUP] = {0};
            memcpy(tmp, y + (size_t)c * ldy, (size_t)rows * sizeof(float));
            acc[c] = _mm256_loadu_ps(tmp);
        }
    }
}

VNNI static void load_pair(__m512 *acc, int mr, const float *y, long ldy, int rows2,
                           int accumulate) {
    for (int c = 0; c < mr; c++) {
        if (!accumulate) {
            acc[c] = _mm512_setzero_ps();
        } else if (rows2 == GROUP) {
            acc[c] = _mm512_loadu_ps(y + (size_t)c * ldy);
        } else {
            float tmp[2 * GROUP] = {0};
            memcpy(tmp, y + (size_t)c * ldy, (size_t)(GROUP + rows2) * sizeof(float));
            acc[c] = _mm512_loadu_ps(tmp);
        }
    }
}

static inline void store_group(const __m256 *acc, int mr, float *y, long ldy, int rows) {
    for (int c = 0; c < mr; c++) {
        if (rows == GROUP) {
            _mm256_storeu_ps(y + (size_t)c * ldy, acc[c]);
        } else {
            float tmp[GROUP];
            _mm256_storeu_ps(tmp, acc[c]);
            memcpy(y + (size_t)c * ldy, tmp, (size_t)rows * sizeof(float));
        }
    }
}

/* Two groups' outputs (acc lanes 0-7 the first, full; 8-15 the second, `rows2` rows) */
VNNI static void store_pair(const __m512 *acc, int mr, float *y, long ldy, int rows2) {
    for (int c = 0; c < mr; c++) {
        if (rows2 == GROUP) {
            _mm512_storeu_ps(y + (size_t)c * ldy, acc[c]);
        } else {
            float tmp[2 * GROUP];
            _mm512_storeu_ps(tmp, acc[c]);
            memcpy(y + (size_t)c * ldy, tmp, (size_t)(GROUP + rows2) * sizeof(float));
        }
    }
}

/* 1 where the VNNI passes of the K-quants take two groups at once in 512-bit vectors
   (di_int8_pairs); the same bits either way. */
static int use_pairs = 1;

int di_int8_pairs(int want) {
    if (want >= 0) use_pairs = want != 0;
    return use_pairs;
}

/* Columns [0, N) of y's rows (ldy apart) = the quantized x (q, dx, sx) times the N weight
   rows packed at `packed` in `fmt`: this thread's share of the groups. `accumulate`: each
   output's sum goes on from y's value (see di_int8_gemm_acc) instead of from zero. */
static void int8_groups_team(int fmt, const uint8_t *packed, const int8_t *q, const float *dx,
                             const float *sx, float *y, long ldy, int M, int N, int K,
                             int accumulate, di_team *team) {
    const int nb = K / QK, groups = (N + GROUP - 1) / GROUP;
    const size_t gb = group_bytes(fmt, K);
    int g0, g1;
    di_team_range(team, groups, &g0, &g1);
    const int vnni = use_vnni, max_rows = vnni ? MR_VNNI : MR;
    group_fn fns[MR_VNNI];
    for (int r = 0; r < max_rows; r++) {
        if (is_kquant(fmt)) {
            fns[r] = di_int8_kquant_pass(fmt, vnni, r + 1);
        } else {
            fns[r] = vnni ? GROUP_FNS_VNNI[fmt][r] : GROUP_FNS[fmt][r];
        }
    }
    pair_fn pairs[MR_VNNI] = {NULL};
    for (int r = 0; vnni && use_pairs && r < max_rows; r++) {
        pairs[r] = di_int8_kquant_pair_pass(fmt, r + 1);
    }
    for (int g = g0; g < g1; g++) {
        const int rows = N - g * GROUP < GROUP ? N - g * GROUP : GROUP;
        const uint8_t *wg = packed + g * gb;
        if (pairs[0] != NULL && g + 1 < g1) { /* two groups in one 512-bit pass */
            const int rows2 = N - (g + 1) * GROUP < GROUP ? N - (g + 1) * GROUP : GROUP;
            for (int m0 = 0; m0 < M; m0 += max_rows) {
                const int mr = M - m0 < max_rows ? M - m0 : max_rows;
                __m512 acc2[MR_VNNI];
                load_pair(acc2, mr, y + (size_t)m0 * ldy + g * GROUP, ldy, rows2, accumulate);
                pairs[mr - 1](wg, wg + gb, nb, q + (size_t)m0 * K, dx + (size_t)m0 * nb,
                              sx + (size_t)m0 * nb, K, m0 == 0, acc2);
                store_pair(acc2, mr, y + (size_t)m0 * ldy + g * GROUP, ldy, rows2);
            }
            g++;
            continue;
        }
        __m256 acc[MR_VNNI];
        for (int m0 = 0; m0 < M; m0 += max_rows) {
            const int mr = M - m0 < max_rows ? M - m0 : max_rows;
            load_group(acc, mr, y + (size_t)m0 * ldy + g * GROUP, ldy, rows, accumulate);
            fns[mr - 1](wg, nb, q + (size_t)m0 * K, dx + (size_t)m0 * nb, sx + (size_t)m0 * nb, K,
                        m0 == 0, acc);
            store_group(acc, mr, y + (size_t)m0 * ldy + g * GROUP, ldy, rows);
        }
    }
}

static void quantize_team(const float *x, int M, int K, int8_t *q, float *dx, float *sx,
                          di_team *team) {
    const int nb = K / QK;
    int r0, r1;
    di_team_range(team, M, &r0, &r1);
    for (int r = r0; r < r1; r++) {
        quantize_row(x + (size_t)r * K, K, q + (size_t)r * K, dx + (size_t)r * nb, sx + (size_t)r * nb);
    }
    di_team_sync(team);
}

long di_int8_split_packed_bytes(int fmt, int fmt2, int N2, int N, int K) {
    if (N2 <= 0) return N2 == 0 ? di_int8_packed_bytes(fmt, N, K) : 0;
    const int N1 = N - N2;
    if (N1 <= 0 || N1 % GROUP) return 0;
    const long a = di_int8_packed_bytes(fmt, N1, K), b = di_int8_packed_bytes(fmt2, N2, K);
    return a > 0 && b > 0 ? a + b : 0;
}

static void int8_matrix_team(const di_matrix *w, const float *x, float *y, int M, int8_t *q,
                             float *dx, float *sx, int accumulate, di_team *team) {
    const int N1 = w->N - w->N2;
    quantize_team(x, M, w->K, q, dx, sx, team);
    int8_groups_team(w->fmt, w->data, q, dx, sx, y, w->N, M, N1, w->K, accumulate, team);
    if (w->N2 > 0) {
        const uint8_t *second = w->data + di_int8_packed_bytes(w->fmt, N1, w->K);
        int8_groups_team(w->fmt2, second, q, dx, sx, y + N1, w->N, M, w->N2, w->K, accumulate,
                         team);
    }
}

void di_int8_matrix_team(const di_matrix *w, const float *x, float *y, int M, int8_t *q,
                         float *dx, float *sx, di_team *team) {
    int8_matrix_team(w, x, y, M, q, dx, sx, 0, team);
}

static int int8_gemm(int fmt, int fmt2, int N2, const uint8_t *packed, const float *x, float *y,
                     int M, int N, int K, int num_threads, int accumulate) {
    if (di_int8_split_packed_bytes(fmt, fmt2, N2, N, K) == 0 || M < 0) return -1;
    if (M == 0) return 0;
    const int nb = K / QK;
    int8_t *q = aligned_alloc(64, ((size_t)M * K + 63) / 64 * 64);
    float *scales = malloc((size_t)M * nb * 2 * sizeof(float));
    if (q == NULL || scales == NULL) {
        free(q);
        free(scales);
        return -2;
    }
    float *dx = scales, *sx = scales + (size_t)M * nb;
    const di_matrix w = {.data = packed, .fmt = fmt, .int8 = 1, .N = N, .K = K, .fmt2 = fmt2,
                         .N2 = N2};
    di_barrier barrier;
    di_barrier_init(&barrier);
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        di_team team = di_team_join(&barrier);
        int8_matrix_team(&w, x, y, M, q, dx, sx, accumulate, &team);
    }
    free(q);
    free(scales);
    return 0;
}

/* y = x @ W^T for a weight whose last N2 rows are in fmt2, packed after the first N - N2 (a
   multiple of GROUP) rows in fmt: a fused projection stored in two formats (llama.cpp's
   Q4_K_M keeps some layers' V rows in Q6_K beside Q4_K Q and K). N2 == 0: one format.
   Returns 0 on success, -1 on bad arguments, -2 when out of memory. */
int di_int8_gemm_split(int fmt, int fmt2, int N2, const uint8_t *packed, const float *x,
                       float *y, int M, int N, int K, int num_threads) {
    return int8_gemm(fmt, fmt2, N2, packed, x, y, M, N, K, num_threads, 0);
}

/* di_int8_gemm_split, each output's sum going on from y's value: the blocks of K are summed
   one after another (a lane per output, no horizontal sum), so y = x1 @ W1^T then this with
   x2 @ W2^T gives the bits of [x1 x2] @ [W1 W2]^T in one product, K1 a multiple of the block.
   Tensor parallel's batch-invariant mode chains the row-cut shards' products this way. */
int di_int8_gemm_acc(int fmt, int fmt2, int N2, const uint8_t *packed, const float *x, float *y,
                     int M, int N, int K, int num_threads) {
    return int8_gemm(fmt, fmt2, N2, packed, x, y, M, N, K, num_threads, 1);
}

/* Returns 0 on success, -1 on bad arguments, -2 when out of memory. */
int di_int8_gemm(int fmt, const uint8_t *packed, const float *x, float *y, int M, int N, int K,
                 int num_threads) {
    return di_int8_gemm_split(fmt, fmt, 0, packed, x, y, M, N, K, num_threads);
}
