/* The int8-activation matmul's K-quant formats (Q4_K, Q5_K, Q6_K): their packing and passes
   (cpu/int8_gemm.c quantizes x and drives the passes; cpu/int8.h is what they share).

   Arithmetic. x is quantized per block of 32 as for every format (scale dx, sx = dx * sum(q_x)).
   A K-quant superblock's 256 weights are 8 sub-blocks of 32, each lined up with one block of x:
     Q4_K, Q5_K (w = D * q - M, D = d * sc, M = dmin * m, both exact in float32):
       dot = (D * dx) * sum(q_w * q_x) - M * sx
     Q6_K (w = D * (q - 32), one D = d * sc per 16 weights): each half of a sub-block is its
       own integer sum, dot = (D_lo * dx) * sum_lo + (D_hi * dx) * sum_hi
   as `int8_linear_reference` computes it. The integer sums are exact (AVX2: int16 pair sums
   widened once per half sub-block, at most 8 x 31 x 127 = 31496 (Q5_K) or 8 x 32 x 127 = 32512
   (Q6_K's q - 32, multiplied as |w| by x with w's sign)); the float steps are the same in the
   AVX2 and the VNNI passes, so both give the same bits.

   Packed group of 8 rows, superblock by superblock (rows past N zero):
     sub-block s (s = 0..7), as Q4_1's group blocks: 4 x 32 bytes of nibbles, byte 4r+i of chunk
       j holding row r's weight 32s+4j+i in its low nibble and 32s+16+4j+i in its high one;
       Q5_K then 32 bytes of fifth bits: bit j of byte 4r+i is that of weight 32s+4j+i, bit
       4+j that of 32s+16+4j+i;
       Q6_K then 2 x 32 bytes of top bit pairs: bits 2j..2j+1 of byte 4r+i of the first hold
       those of weight 32s+4j+i, of the second those of 32s+16+4j+i;
     then the scales, 8 lanes at a time: Q4_K/Q5_K: d[8], dmin[8] (float16), sc[8 sub-blocks][8]
       and m[8][8] (bytes); Q6_K: d[8] (float16), sc[16 halves][8] (int8).
   Per row of a superblock: 148 bytes for Q4_K's 144, 180 for Q5_K's 176, 210 for Q6_K's 210.
*/
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "deepinfer_kernels.h"
#include "int8.h"
#include "parts.h"

#define QK DI_QK
#define SUBS (DI_QK_K / DI_QK) /* sub-blocks of 32 a superblock */

/* Bytes of one sub-block's quants for 8 rows, and of a whole superblock for 8 rows */
#define Q4K_SUB 128
#define Q5K_SUB 160
#define Q6K_SUB 192
#define Q4K_GROUP (SUBS * Q4K_SUB + 2 * 16 + 2 * 64)
#define Q5K_GROUP (SUBS * Q5K_SUB + 2 * 16 + 2 * 64)
#define Q6K_GROUP (SUBS * Q6K_SUB + 16 + 128)

long di_int8_kquant_group_bytes(int fmt, int K) {
    const long sbs = K / DI_QK_K;
    switch (fmt) {
    case DI_FMT_Q4_K:
        return sbs * Q4K_GROUP;
    case DI_FMT_Q5_K:
        return sbs * Q5K_GROUP;
    case DI_FMT_Q6_K:
        return sbs * Q6K_GROUP;
    default:
        return 0;
    }
}

/* ---- packing ---- */

/* A superblock's 256 quants as bytes: Q4_K 0-15, Q5_K 0-31, Q6_K 0-63 (before its - 32) */
static void unpack_quants(int fmt, const uint8_t *blk, uint8_t *q) {
    if (fmt == DI_FMT_Q6_K) {
        const block_q6_k *b = (const block_q6_k *)blk;
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < 128; r++) {
                const int lo = (b->ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
                const int hi = (b->qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
                q[128 * h + r] = (uint8_t)(lo | hi << 4);
            }
        }
        return;
    }
    const uint8_t *qs = fmt == DI_FMT_Q4_K ? ((const block_q4_k *)blk)->qs
                                           : ((const block_q5_k *)blk)->qs;
    for (int s = 0; s < SUBS; s++) {
        for (int i = 0; i < QK; i++) {
            int v = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 0x0F;
            if (fmt == DI_FMT_Q5_K) v |= ((((const block_q5_k *)blk)->qh[i] >> s) & 1) << 4;
            q[QK * s + i] = (uint8_t)v;
        }
    }
}

/* Row r's quants of one superblock into the group's sub-blocks (`sub` bytes apart) */
static void pack_quants(int fmt, const uint8_t *q, int r, uint8_t *out, int sub) {
    for (int s = 0; s < SUBS; s++) {
        uint8_t *o = out + (size_t)s * sub;
        for (int j = 0; j < 4; j++) {
            for (int i = 0; i < 4; i++) {
                const int lw = q[QK * s + 4 * j + i], hw = q[QK * s + 16 + 4 * j + i];
                const int at = 4 * r + i;
                o[32 * j + at] = (uint8_t)((lw & 0x0F) | (hw & 0x0F) << 4);
                if (fmt == DI_FMT_Q5_K) {
                    o[128 + at] |= (uint8_t)(((lw >> 4) & 1) << j | ((hw >> 4) & 1) << (4 + j));
                } else if (fmt == DI_FMT_Q6_K) {
                    o[128 + at] |= (uint8_t)(((lw >> 4) & 3) << (2 * j));
                    o[160 + at] |= (uint8_t)(((hw >> 4) & 3) << (2 * j));
                }
            }
        }
    }
}

/* Row r's scales of one superblock into the group's scale lanes at `tail` */
static void pack_scales(int fmt, const uint8_t *blk, int r, uint8_t *tail) {
    if (fmt == DI_FMT_Q6_K) {
        const block_q6_k *b = (const block_q6_k *)blk;
        memcpy(tail + 2 * r, &b->d, 2);
        for (int t = 0; t < 16; t++) tail[16 + 8 * t + r] = (uint8_t)b->scales[t];
        return;
    }
    const block_q4_k *b = (const block_q4_k *)blk; /* Q5_K's header is Q4_K's */
    memcpy(tail + 2 * r, &b->d, 2);
    memcpy(tail + 16 + 2 * r, &b->dmin, 2);
    for (int s = 0; s < SUBS; s++) {
        di_k4_scale_min(b->scales, s, &tail[32 + 8 * s + r], &tail[96 + 8 * s + r]);
    }
}

void di_int8_kquant_pack(int fmt, const uint8_t *w, int rows, int K, uint8_t *out) {
    const int sbs = K / DI_QK_K;
    const int sub = fmt == DI_FMT_Q4_K ? Q4K_SUB : fmt == DI_FMT_Q5_K ? Q5K_SUB : Q6K_SUB;
    const size_t gb = (size_t)di_int8_kquant_group_bytes(fmt, DI_QK_K);
    const size_t rb = di_row_bytes(fmt, K), bb = di_block_bytes(fmt);
    memset(out, 0, gb * sbs);
    for (int b = 0; b < sbs; b++, out += gb) {
        for (int r = 0; r < rows; r++) {
            const uint8_t *blk = w + r * rb + b * bb;
            uint8_t q[DI_QK_K];
            unpack_quants(fmt, blk, q);
            pack_quants(fmt, q, r, out, sub);
            pack_scales(fmt, blk, r, out + (size_t)SUBS * sub);
        }
    }
}

/* ---- passes ---- */

/* 8 bytes at `p` as float32 lanes, unsigned or signed */
static inline __m256 u8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 i8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Bits 2j..2j+1 of every byte of h at bits 4..5 (the rest of the byte is masked off after) */
static inline __m256i pair_at4(__m256i h, int j) {
    switch (j) {
    case 0:
        return _mm256_slli_epi16(h, 4);
    case 1:
        return _mm256_slli_epi16(h, 2);
    case 2:
        return h;
    default:
        return _mm256_srli_epi16(h, 2);
    }
}

/* The integer sums: AVX2 adds `vpmaddubsw`'s int16 pair sums and widens them once (DONE);
   VNNI's `vpdpbusd` sums into int32 lanes directly. */
#define ACC_AVX2(s, w, x) ((s) = _mm256_add_epi16((s), _mm256_maddubs_epi16((w), (x))))
#define DONE_AVX2(s) _mm256_madd_epi16((s), _mm256_set1_epi16(1))
#define ACC_VNNI(s, w, x) ((s) = _mm256_dpbusd_epi32((s), (w), (x)))
#define DONE_VNNI(s) (s)

/* What a sub-block at `o` needs before its chunks: Q5_K's fifth bits */
#define Q4K_SETUP(o)
#define Q5K_SETUP(o)                                                                           \
    const __m256i fifth = _mm256_set1_epi8(0x10);                                              \
    const __m256i h5 = _mm256_loadu_si256((const __m256i *)((o) + 128))

/* One sub-block's weights of 8 rows (4 weights each) for chunk j: lo = weights 4j.., hi =
   16+4j.. of the sub-block at `o`, as bytes ready to multiply (see each format). */
#define Q4K_WEIGHTS(o, j, lo, hi)                                                              \
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((o) + 32 * (j)));                 \
    const __m256i lo = _mm256_and_si256(raw, low);                                             \
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low)

#define Q5K_WEIGHTS(o, j, lo, hi)                                                              \
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((o) + 32 * (j)));                 \
    const __m256i lo = _mm256_or_si256(                                                        \
        _mm256_and_si256(raw, low), _mm256_and_si256(_mm256_slli_epi16(h5, 4 - (j)), fifth));  \
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),       \
                                       _mm256_and_si256(_mm256_srli_epi16(h5, (j)), fifth))

/* Q4_K and Q5_K: sum_lo + sum_hi scaled by D * dx, minus M * sx */
#define PASS_K4(NAME, R, ATTR, ACC, DONE, SUB, GB, SETUP, WEIGHTS)                             \
    ATTR static void NAME(const uint8_t *g, int nb, const int8_t *q, const float *dx,          \
                          const float *sx, int K, int pf, __m256 *acc) {                       \
        const __m256i low = _mm256_set1_epi8(0x0F);                                            \
        __m256 a[R];                                                                           \
        for (int c = 0; c < R; c++) a[c] = acc[c];                                             \
        for (int b0 = 0; b0 < nb; b0 += SUBS, g += (GB)) {                                     \
            if (pf) prefetch_block(g, (GB));                                                   \
            const uint8_t *tail = g + SUBS * (SUB);                                            \
            const __m256 d = scales8(tail), dmin = scales8(tail + 16);                         \
            _Pragma("GCC unroll 1") for (int s = 0; s < SUBS; s++) {                           \
                const uint8_t *o = g + s * (SUB);                                              \
                SETUP(o);                                                                      \
                __m256i s_lo[R], s_hi[R];                                                      \
                for (int c = 0; c < R; c++) s_lo[c] = s_hi[c] = _mm256_setzero_si256();        \
                const int8_t *qb = q + (size_t)(b0 + s) * QK;                                  \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                          \
                    WEIGHTS(o, j, lo, hi);                                                     \
                    for (int c = 0; c < R; c++) {                                              \
                        const int8_t *qc = qb + (size_t)c * K;                                 \
                        ACC(s_lo[c], lo, bcast4(qc + 4 * j));                                  \
                        ACC(s_hi[c], hi, bcast4(qc + 16 + 4 * j));                             \
                    }                                                                          \
                }                                                                              \
                const __m256 ds = _mm256_mul_ps(d, u8x8_ps(tail + 32 + 8 * s));                \
                const __m256 ms = _mm256_mul_ps(dmin, u8x8_ps(tail + 96 + 8 * s));             \
                for (int c = 0; c < R; c++) {                                                  \
                    const size_t at = (size_t)c * nb + b0 + s;                                 \
                    const __m256 dot =                                                         \
                        _mm256_cvtepi32_ps(_mm256_add_epi32(DONE(s_lo[c]), DONE(s_hi[c])));    \
                    a[c] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ds, _mm256_set1_ps(dx[at])), a[c]); \
                    a[c] = _mm256_fnmadd_ps(ms, _mm256_set1_ps(sx[at]), a[c]);                 \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int c = 0; c < R; c++) acc[c] = a[c];                                             \
    }

/* Q6_K: each half sub-block's sum scaled by its own D * dx */
#define PASS_Q6K(NAME, R, ATTR, ACC, DONE)                                                     \
    ATTR static void NAME(const uint8_t *g, int nb, const int8_t *q, const float *dx,          \
                          const float *sx, int K, int pf, __m256 *acc) {                       \
        (void)sx;                                                                              \
        const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);              \
        const __m256i offset = _mm256_set1_epi8(32);                                           \
        __m256 a[R];                                                                           \
        for (int c = 0; c < R; c++) a[c] = acc[c];                                             \
        for (int b0 = 0; b0 < nb; b0 += SUBS, g += Q6K_GROUP) {                                \
            if (pf) prefetch_block(g, Q6K_GROUP);                                              \
            const uint8_t *tail = g + SUBS * Q6K_SUB;                                          \
            const __m256 d = scales8(tail);                                                    \
            _Pragma("GCC unroll 1") for (int s = 0; s < SUBS; s++) {                           \
                const uint8_t *o = g + s * Q6K_SUB;                                            \
                const __m256i h_lo = _mm256_loadu_si256((const __m256i *)(o + 128));           \
                const __m256i h_hi = _mm256_loadu_si256((const __m256i *)(o + 160));           \
                __m256i s_lo[R], s_hi[R];                                                      \
                for (int c = 0; c < R; c++) s_lo[c] = s_hi[c] = _mm256_setzero_si256();        \
                const int8_t *qb = q + (size_t)(b0 + s) * QK;                                  \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                          \
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(o + 32 * j));     \
                    const __m256i lo = _mm256_sub_epi8(                                        \
                        _mm256_or_si256(_mm256_and_si256(raw, low),                            \
                                        _mm256_and_si256(pair_at4(h_lo, j), top)),             \
                        offset);                                                               \
                    const __m256i hi = _mm256_sub_epi8(                                        \
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),      \
                                        _mm256_and_si256(pair_at4(h_hi, j), top)),             \
                        offset);                                                               \
                    const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);        \
                    for (int c = 0; c < R; c++) {                                              \
                        const int8_t *qc = qb + (size_t)c * K;                                 \
                        ACC(s_lo[c], alo, _mm256_sign_epi8(bcast4(qc + 4 * j), lo));           \
                        ACC(s_hi[c], ahi, _mm256_sign_epi8(bcast4(qc + 16 + 4 * j), hi));      \
                    }                                                                          \
                }                                                                              \
                const __m256 d_lo = _mm256_mul_ps(d, i8x8_ps(tail + 16 + 16 * s));             \
                const __m256 d_hi = _mm256_mul_ps(d, i8x8_ps(tail + 24 + 16 * s));             \
                for (int c = 0; c < R; c++) {                                                  \
                    const __m256 vdx = _mm256_set1_ps(dx[(size_t)c * nb + b0 + s]);            \
                    a[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DONE(s_lo[c])),                  \
                                           _mm256_mul_ps(d_lo, vdx), a[c]);                    \
                    a[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DONE(s_hi[c])),                  \
                                           _mm256_mul_ps(d_hi, vdx), a[c]);                    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int c = 0; c < R; c++) acc[c] = a[c];                                             \
    }

/* The K-quant VNNI passes on two adjacent groups at once, in 512-bit vectors: lanes 0-7
   are the first group's rows, 8-15 the second's. Each lane does the very operations of the
   256-bit pass above, in the same order, so the bits are the same; a vector instruction does
   twice the work where the core has two 512-bit units. */
VNNI static inline __m512i load_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
VNNI static inline __m512 scales_pair(const uint8_t *a, const uint8_t *b) {
    const __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
        _mm_loadu_si128((const __m128i *)b), 1);
    return _mm512_cvtph_ps(h);
}
VNNI static inline __m512 u8_pair_ps(const uint8_t *a, const uint8_t *b) {
    const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                         _mm_loadl_epi64((const __m128i *)b));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
VNNI static inline __m512i bcast4_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

#define Q4K_SETUP2(o, o2)
#define Q5K_SETUP2(o, o2)                                                                      \
    const __m512i fifth = _mm512_set1_epi8(0x10);                                              \
    const __m512i h5 = load_pair((o) + 128, (o2) + 128)
#define Q4K_WEIGHTS2(o, o2, j, lo, hi)                                                         \
    const __m512i raw = load_pair((o) + 32 * (j), (o2) + 32 * (j));                            \
    const __m512i lo = _mm512_and_si512(raw, low);                                             \
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low)
#define Q5K_WEIGHTS2(o, o2, j, lo, hi)                                                         \
    const __m512i raw = load_pair((o) + 32 * (j), (o2) + 32 * (j));                            \
    const __m512i lo = _mm512_or_si512(                                                        \
        _mm512_and_si512(raw, low), _mm512_and_si512(_mm512_slli_epi16(h5, 4 - (j)), fifth));  \
    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low),       \
                                       _mm512_and_si512(_mm512_srli_epi16(h5, (j)), fifth))

#define PASS_K4_PAIR(NAME, R, SUB, GB, SETUP, WEIGHTS)                                         \
    VNNI static void NAME(const uint8_t *g, const uint8_t *g2, int nb, const int8_t *q,        \
                          const float *dx, const float *sx, int K, int pf, __m512 *acc) {      \
        const __m512i low = _mm512_set1_epi8(0x0F);                                            \
        __m512 a[R];                                                                           \
        for (int c = 0; c < R; c++) a[c] = acc[c];                                             \
        for (int b0 = 0; b0 < nb; b0 += SUBS, g += (GB), g2 += (GB)) {                         \
            if (pf) {                                                                          \
                prefetch_block(g, (GB));                                                       \
                prefetch_block(g2, (GB));                                                      \
            }                                                                                  \
            const uint8_t *tail = g + SUBS * (SUB), *tail2 = g2 + SUBS * (SUB);                \
            const __m512 d = scales_pair(tail, tail2);                                         \
            const __m512 dmin = scales_pair(tail + 16, tail2 + 16);                            \
            _Pragma("GCC unroll 1") for (int s = 0; s < SUBS; s++) {                           \
                const uint8_t *o = g + s * (SUB), *o2 = g2 + s * (SUB);                        \
                SETUP(o, o2);                                                                  \
                __m512i s_lo[R], s_hi[R];                                                      \
                for (int c = 0; c < R; c++) s_lo[c] = s_hi[c] = _mm512_setzero_si512();        \
                const int8_t *qb = q + (size_t)(b0 + s) * QK;                                  \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                          \
                    WEIGHTS(o, o2, j, lo, hi);                                                 \
                    for (int c = 0; c < R; c++) {                                              \
                        const int8_t *qc = qb + (size_t)c * K;                                 \
                        s_lo[c] = _mm512_dpbusd_epi32(s_lo[c], lo, bcast4_512(qc + 4 * j));    \
                        s_hi[c] = _mm512_dpbusd_epi32(s_hi[c], hi, bcast4_512(qc + 16 + 4 * j)); \
                    }                                                                          \
                }                                                                              \
                const __m512 ds =                                                              \
                    _mm512_mul_ps(d, u8_pair_ps(tail + 32 + 8 * s, tail2 + 32 + 8 * s));       \
                const __m512 ms =                                                              \
                    _mm512_mul_ps(dmin, u8_pair_ps(tail + 96 + 8 * s, tail2 + 96 + 8 * s));    \
                for (int c = 0; c < R; c++) {                                                  \
                    const size_t at = (size_t)c * nb + b0 + s;                                 \
                    const __m512 dot =                                                         \
                        _mm512_cvtepi32_ps(_mm512_add_epi32(s_lo[c], s_hi[c]));                \
                    a[c] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ds, _mm512_set1_ps(dx[at])), a[c]); \
                    a[c] = _mm512_fnmadd_ps(ms, _mm512_set1_ps(sx[at]), a[c]);                 \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int c = 0; c < R; c++) acc[c] = a[c];                                             \
    }

VNNI static inline __m512 i8_pair_ps(const uint8_t *a, const uint8_t *b) {
    const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                         _mm_loadl_epi64((const __m128i *)b));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

/* pair_at4 on 512-bit vectors */
VNNI static inline __m512i pair_at4_512(__m512i h, int j) {
    switch (j) {
    case 0:
        return _mm512_slli_epi16(h, 4);
    case 1:
        return _mm512_slli_epi16(h, 2);
    case 2:
        return h;
    default:
        return _mm512_srli_epi16(h, 2);
    }
}

/* Q6_K on two groups: 512-bit vectors have no byte sign instruction, so x is negated where the
   weight is negative by a masked subtraction (the same bytes as `vpsignb` where the weight is
   not zero; where it is, |w| is 0 and so is the product either way). */
#define PASS_Q6K_PAIR(NAME, R)                                                                 \
    VNNI static void NAME(const uint8_t *g, const uint8_t *g2, int nb, const int8_t *q,        \
                          const float *dx, const float *sx, int K, int pf, __m512 *acc) {      \
        (void)sx;                                                                              \
        const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);              \
        const __m512i offset = _mm512_set1_epi8(32), zero = _mm512_setzero_si512();            \
        __m512 a[R];                                                                           \
        for (int c = 0; c < R; c++) a[c] = acc[c];                                             \
        for (int b0 = 0; b0 < nb; b0 += SUBS, g += Q6K_GROUP, g2 += Q6K_GROUP) {               \
            if (pf) {                                                                          \
                prefetch_block(g, Q6K_GROUP);                                                  \
                prefetch_block(g2, Q6K_GROUP);                                                 \
            }                                                                                  \
            const uint8_t *tail = g + SUBS * Q6K_SUB, *tail2 = g2 + SUBS * Q6K_SUB;            \
            const __m512 d = scales_pair(tail, tail2);                                         \
            _Pragma("GCC unroll 1") for (int s = 0; s < SUBS; s++) {                           \
                const uint8_t *o = g + s * Q6K_SUB, *o2 = g2 + s * Q6K_SUB;                    \
                const __m512i h_lo = load_pair(o + 128, o2 + 128);                             \
                const __m512i h_hi = load_pair(o + 160, o2 + 160);                             \
                __m512i s_lo[R], s_hi[R];                                                      \
                for (int c = 0; c < R; c++) s_lo[c] = s_hi[c] = _mm512_setzero_si512();        \
                const int8_t *qb = q + (size_t)(b0 + s) * QK;                                  \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                          \
                    const __m512i raw = load_pair(o + 32 * j, o2 + 32 * j);                    \
                    const __m512i lo = _mm512_sub_epi8(                                        \
                        _mm512_or_si512(_mm512_and_si512(raw, low),                            \
                                        _mm512_and_si512(pair_at4_512(h_lo, j), top)),         \
                        offset);                                                               \
                    const __m512i hi = _mm512_sub_epi8(                                        \
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low),      \
                                        _mm512_and_si512(pair_at4_512(h_hi, j), top)),         \
                        offset);                                                               \
                    const __m512i alo = _mm512_abs_epi8(lo), ahi = _mm512_abs_epi8(hi);        \
                    const __mmask64 nlo = _mm512_movepi8_mask(lo);                             \
                    const __mmask64 nhi = _mm512_movepi8_mask(hi);                             \
                    for (int c = 0; c < R; c++) {                                              \
                        const int8_t *qc = qb + (size_t)c * K;                                 \
                        const __m512i xl = bcast4_512(qc + 4 * j);                             \
                        const __m512i xh = bcast4_512(qc + 16 + 4 * j);                        \
                        s_lo[c] = _mm512_dpbusd_epi32(s_lo[c], alo,                            \
                                                      _mm512_mask_sub_epi8(xl, nlo, zero, xl)); \
                        s_hi[c] = _mm512_dpbusd_epi32(s_hi[c], ahi,                            \
                                                      _mm512_mask_sub_epi8(xh, nhi, zero, xh)); \
                    }                                                                          \
                }                                                                              \
                const __m512 d_lo =                                                            \
                    _mm512_mul_ps(d, i8_pair_ps(tail + 16 + 16 * s, tail2 + 16 + 16 * s));     \
                const __m512 d_hi =                                                            \
                    _mm512_mul_ps(d, i8_pair_ps(tail + 24 + 16 * s, tail2 + 24 + 16 * s));     \
                for (int c = 0; c < R; c++) {                                                  \
                    const __m512 vdx = _mm512_set1_ps(dx[(size_t)c * nb + b0 + s]);            \
                    a[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_lo[c]),                        \
                                           _mm512_mul_ps(d_lo, vdx), a[c]);                    \
                    a[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_hi[c]),                        \
                                           _mm512_mul_ps(d_hi, vdx), a[c]);                    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int c = 0; c < R; c++) acc[c] = a[c];                                             \
    }

#define PASSES_PAIR(R)                                                                         \
    PASS_K4_PAIR(q4k_pair_x##R, R, Q4K_SUB, Q4K_GROUP, Q4K_SETUP2, Q4K_WEIGHTS2)               \
    PASS_K4_PAIR(q5k_pair_x##R, R, Q5K_SUB, Q5K_GROUP, Q5K_SETUP2, Q5K_WEIGHTS2)               \
    PASS_Q6K_PAIR(q6k_pair_x##R, R)


PASSES_PAIR(1)
PASSES_PAIR(2)
PASSES_PAIR(3)
PASSES_PAIR(4)
PASSES_PAIR(5)
PASSES_PAIR(6)
PASSES_PAIR(7)
PASSES_PAIR(8)

static const pair_fn PAIR_PASSES[3][MR_VNNI] = {
    {q4k_pair_x1, q4k_pair_x2, q4k_pair_x3, q4k_pair_x4, q4k_pair_x5, q4k_pair_x6, q4k_pair_x7,
     q4k_pair_x8},
    {q5k_pair_x1, q5k_pair_x2, q5k_pair_x3, q5k_pair_x4, q5k_pair_x5, q5k_pair_x6, q5k_pair_x7,
     q5k_pair_x8},
    {q6k_pair_x1, q6k_pair_x2, q6k_pair_x3, q6k_pair_x4, q6k_pair_x5, q6k_pair_x6, q6k_pair_x7,
     q6k_pair_x8},
};

pair_fn di_int8_kquant_pair_pass(int fmt, int rows) {
    if (fmt != DI_FMT_Q4_K && fmt != DI_FMT_Q5_K && fmt != DI_FMT_Q6_K) return NULL;
    return PAIR_PASSES[fmt - DI_FMT_Q4_K][rows - 1];
}

#define NOATTR
#define PASSES_AVX2(R)                                                                         \
    PASS_K4(q4k_x##R, R, NOATTR, ACC_AVX2, DONE_AVX2, Q4K_SUB, Q4K_GROUP, Q4K_SETUP,           \
            Q4K_WEIGHTS)                                                                       \
    PASS_K4(q5k_x##R, R, NOATTR, ACC_AVX2, DONE_AVX2, Q5K_SUB, Q5K_GROUP, Q5K_SETUP,           \
            Q5K_WEIGHTS)                                                                       \
    PASS_Q6K(q6k_x##R, R, NOATTR, ACC_AVX2, DONE_AVX2)
#define PASSES_VNNI(R)                                                                         \
    PASS_K4(q4k_vnni_x##R, R, VNNI, ACC_VNNI, DONE_VNNI, Q4K_SUB, Q4K_GROUP, Q4K_SETUP,        \
            Q4K_WEIGHTS)                                                                       \
    PASS_K4(q5k_vnni_x##R, R, VNNI, ACC_VNNI, DONE_VNNI, Q5K_SUB, Q5K_GROUP, Q5K_SETUP,        \
            Q5K_WEIGHTS)                                                                       \
    PASS_Q6K(q6k_vnni_x##R, R, VNNI, ACC_VNNI, DONE_VNNI)

PASSES_AVX2(1)
PASSES_AVX2(2)
PASSES_AVX2(3)
PASSES_AVX2(4)
PASSES_VNNI(1)
PASSES_VNNI(2)
PASSES_VNNI(3)
PASSES_VNNI(4)
PASSES_VNNI(5)
PASSES_VNNI(6)
PASSES_VNNI(7)
PASSES_VNNI(8)

static const group_fn AVX2_PASSES[3][MR] = {
    {q4k_x1, q4k_x2, q4k_x3, q4k_x4},
    {q5k_x1, q5k_x2, q5k_x3, q5k_x4},
    {q6k_x1, q6k_x2, q6k_x3, q6k_x4},
};
static const group_fn VNNI_PASSES[3][MR_VNNI] = {
    {q4k_vnni_x1, q4k_vnni_x2, q4k_vnni_x3, q4k_vnni_x4, q4k_vnni_x5, q4k_vnni_x6, q4k_vnni_x7,
     q4k_vnni_x8},
    {q5k_vnni_x1, q5k_vnni_x2, q5k_vnni_x3, q5k_vnni_x4, q5k_vnni_x5, q5k_vnni_x6, q5k_vnni_x7,
     q5k_vnni_x8},
    {q6k_vnni_x1, q6k_vnni_x2, q6k_vnni_x3, q6k_vnni_x4, q6k_vnni_x5, q6k_vnni_x6, q6k_vnni_x7,
     q6k_vnni_x8},
};

group_fn di_int8_kquant_pass(int fmt, int vnni, int rows) {
    const int f = fmt - DI_FMT_Q4_K;
    return vnni ? VNNI_PASSES[f][rows - 1] : AVX2_PASSES[f][rows - 1];
}
