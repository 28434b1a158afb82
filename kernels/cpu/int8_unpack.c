/* Packed int8-matmul weights back to rows of bfloat16, a tile of groups at a time: the
   operand of a bf16 matmul (torch's, which runs on AMX tiles or AVX-512 BF16 where the CPU has
   them) for long prefill chunks, where that beats the int8 kernel even with this unpacking.

   A weight is computed as `dequantize_reference` computes it in float32 (Q4_1: d * q + m;
   Q8_0: d * q; Q4_K/Q5_K: (d * sc) * q - dmin * m; Q6_K: (d * sc) * (q - 32)), then rounded to
   bfloat16 to nearest, ties to even, as torch's `.to(torch.bfloat16)` rounds: the same bits.
   The layouts read are those cpu/int8_gemm.c and cpu/int8_kquants.c pack. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "deepinfer_kernels.h"
#include "int8.h"

#define QK DI_QK
#define SUBS (DI_QK_K / DI_QK)

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* out[k] = bf16(a * q[k] + b) for 32 weights, a = a_lo for the first 16 and a_hi for the
   rest (Q6_K's two scales a sub-block); b the already negated offset, or -0 (x + -0 is x, signed zeros too) */
static inline void affine32(const float *q, float a_lo, float a_hi, float b, uint16_t *out) {
    const __m256 vb = _mm256_set1_ps(b);
    for (int k = 0; k < QK; k += 16) {
        const __m256 va = _mm256_set1_ps(k == 0 ? a_lo : a_hi);
        __m256i u[2];
        for (int h = 0; h < 2; h++) {
            /* a * q first, then + b: two roundings, as the reference (no fused multiply-add) */
            const __m256 w = _mm256_add_ps(_mm256_mul_ps(va, _mm256_loadu_ps(q + k + 8 * h)), vb);
            const __m256i bits = _mm256_castps_si256(w);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
            u[h] = _mm256_srli_epi32(
                _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
        }
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u[0], u[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(out + k), packed);
    }
}

/* Row r's 32 quants of a chunked block: byte 4r+i of 32-byte chunk j holds weight 4j+i in its
   low nibble and 16+4j+i in its high one (Q4_1, Q4_K, Q5_K, Q6_K's low bits). */
static inline void nibbles(const uint8_t *o, int r, int *q) {
    for (int j = 0; j < 4; j++) {
        for (int i = 0; i < 4; i++) {
            const int b = o[32 * j + 4 * r + i];
            q[4 * j + i] = b & 0x0F;
            q[16 + 4 * j + i] = b >> 4;
        }
    }
}

/* Rows 0-7 of four 32-byte chunks (dword r of a chunk is row r's): row r's 16 bytes, dword j
   from chunk j, are the low half of out[r] for r < 4 and the high half of out[r - 4] after. */
static inline void transpose4(const uint8_t *c0, const uint8_t *c1, const uint8_t *c2,
                              const uint8_t *c3, __m256i out[4]) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)c0);
    const __m256i b = _mm256_loadu_si256((const __m256i *)c1);
    const __m256i c = _mm256_loadu_si256((const __m256i *)c2);
    const __m256i d = _mm256_loadu_si256((const __m256i *)c3);
    const __m256i t0 = _mm256_unpacklo_epi32(a, b), t1 = _mm256_unpackhi_epi32(a, b);
    const __m256i t2 = _mm256_unpacklo_epi32(c, d), t3 = _mm256_unpackhi_epi32(c, d);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* Row r's 16 bytes of a transpose4 */
static inline __m128i row16(const __m256i t[4], int r) {
    return r < 4 ? _mm256_castsi256_si128(t[r]) : _mm256_extracti128_si256(t[r - 4], 1);
}

/* bf16(a * q + b) of 16 integer quants (int32 lanes from 16 bytes, signed or not) */
static inline void affine16(__m256i q_lo, __m256i q_hi, float a, float b, uint16_t *out) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    __m256i u[2];
    const __m256i q[2] = {q_lo, q_hi};
    for (int h = 0; h < 2; h++) {
        const __m256 w = _mm256_add_ps(_mm256_mul_ps(va, _mm256_cvtepi32_ps(q[h])), vb);
        const __m256i bits = _mm256_castps_si256(w);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        u[h] = _mm256_srli_epi32(
            _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    }
    _mm256_storeu_si256((__m256i *)out,
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(u[0], u[1]), 0xD8));
}

static inline void affine16_u8(__m128i q, float a, float b, uint16_t *out) {
    affine16(_mm256_cvtepu8_epi32(q), _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), a, b, out);
}
static inline void affine16_i8(__m128i q, float a, float b, uint16_t *out) {
    affine16(_mm256_cvtepi8_epi32(q), _mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)), a, b, out);
}

/* Q4_K and Q6_K (the formats of most Q4_K_M weights) and Q8_0, vectorized: a sub-block's 8 rows
   at once. The arithmetic per weight is the scalar path's. */
static void unpack_group_fast(int fmt, const uint8_t *g, int rows, int K, uint16_t *out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (fmt == DI_FMT_Q8_0) {
        for (int b = 0; b < K / QK; b++, g += 272) {
            __m256i t0[4], t1[4];
            transpose4(g, g + 32, g + 64, g + 96, t0);
            transpose4(g + 128, g + 160, g + 192, g + 224, t1);
            for (int r = 0; r < rows; r++) {
                uint16_t *o = out + (size_t)r * K + (size_t)b * QK;
                const float d = half_at(g + 256 + 2 * r);
                affine16_i8(row16(t0, r), d, -0.0f, o);
                affine16_i8(row16(t1, r), d, -0.0f, o + 16);
            }
        }
        return;
    }
    const int sub = fmt == DI_FMT_Q4_K ? 128 : 192;
    const size_t gb = (size_t)di_int8_kquant_group_bytes(fmt, DI_QK_K);
    for (int b = 0; b < K / DI_QK_K; b++, g += gb) {
        const uint8_t *tail = g + (size_t)SUBS * sub;
        for (int s = 0; s < SUBS; s++) {
            const uint8_t *o = g + (size_t)s * sub;
            __m256i t[4], lo[4], hi[4];
            transpose4(o, o + 32, o + 64, o + 96, t);
            for (int p = 0; p < 4; p++) {
                lo[p] = _mm256_and_si256(t[p], low);
                hi[p] = _mm256_and_si256(_mm256_srli_epi16(t[p], 4), low);
            }
            if (fmt == DI_FMT_Q6_K) {
                /* top bits: byte 4r+i of o+128 (o+160) holds, at bits 2j.., those of weight
                   4j+i (16+4j+i): byte 4j+i of row r's vector is byte 4r+i, shifted by 2j */
                const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
                const __m256i three = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
                for (int p = 0; p < 4; p++) {
                    for (int half = 0; half < 2; half++) {
                        const uint8_t *tb = o + 128 + 32 * half;
                        int32_t a, c;
                        memcpy(&a, tb + 4 * p, 4);       /* row p */
                        memcpy(&c, tb + 4 * (p + 4), 4); /* row p + 4 */
                        const __m256i v = _mm256_setr_epi32(a, a, a, a, c, c, c, c);
                        const __m256i top = _mm256_slli_epi16(
                            _mm256_and_si256(_mm256_srlv_epi32(v, shifts), three), 4);
                        __m256i *q = half ? &hi[p] : &lo[p];
                        *q = _mm256_sub_epi8(_mm256_or_si256(*q, top), off);
                    }
                }
            }
            for (int r = 0; r < rows; r++) {
                uint16_t *dst = out + (size_t)r * K + (size_t)b * DI_QK_K + (size_t)s * QK;
                const float d = half_at(tail + 2 * r);
                const __m128i qlo = row16(lo, r), qhi = row16(hi, r);
                if (fmt == DI_FMT_Q6_K) {
                    affine16_i8(qlo, d * (float)(int8_t)tail[16 + 8 * (2 * s) + r], -0.0f, dst);
                    affine16_i8(qhi, d * (float)(int8_t)tail[16 + 8 * (2 * s + 1) + r], -0.0f,
                                dst + 16);
                } else {
                    const float D = d * (float)tail[32 + 8 * s + r];
                    const float M = half_at(tail + 16 + 2 * r) * (float)tail[96 + 8 * s + r];
                    affine16_u8(qlo, D, -M, dst);
                    affine16_u8(qhi, D, -M, dst + 16);
                }
            }
        }
    }
}

static void unpack_group(int fmt, const uint8_t *g, int rows, int K, uint16_t *out) {
    if (fmt == DI_FMT_Q4_K || fmt == DI_FMT_Q6_K || fmt == DI_FMT_Q8_0) {
        unpack_group_fast(fmt, g, rows, K, out);
        return;
    }
    float f[QK];
    int q[QK];
    if (fmt == DI_FMT_Q4_1 || fmt == DI_FMT_Q8_0) {
        const size_t gbb = fmt == DI_FMT_Q4_1 ? 160 : 272;
        for (int b = 0; b < K / QK; b++, g += gbb) {
            for (int r = 0; r < rows; r++) {
                uint16_t *o = out + (size_t)r * K + (size_t)b * QK;
                if (fmt == DI_FMT_Q4_1) {
                    nibbles(g, r, q);
                    for (int k = 0; k < QK; k++) f[k] = (float)q[k];
                    const float d = half_at(g + 128 + 2 * r);
                    affine32(f, d, d, half_at(g + 144 + 2 * r), o);
                } else {
                    for (int j = 0; j < 8; j++) {
                        for (int i = 0; i < 4; i++) f[4 * j + i] = (float)(int8_t)g[32 * j + 4 * r + i];
                    }
                    const float d = half_at(g + 256 + 2 * r);
                    affine32(f, d, d, -0.0f, o);
                }
            }
        }
        return;
    }
    const int sub = fmt == DI_FMT_Q4_K ? 128 : fmt == DI_FMT_Q5_K ? 160 : 192;
    const size_t gb = (size_t)di_int8_kquant_group_bytes(fmt, DI_QK_K);
    for (int b = 0; b < K / DI_QK_K; b++, g += gb) {
        const uint8_t *tail = g + (size_t)SUBS * sub;
        for (int r = 0; r < rows; r++) {
            const float d = half_at(tail + 2 * r);
            for (int s = 0; s < SUBS; s++) {
                const uint8_t *o = g + (size_t)s * sub;
                uint16_t *dst = out + (size_t)r * K + (size_t)b * DI_QK_K + (size_t)s * QK;
                nibbles(o, r, q);
                if (fmt == DI_FMT_Q6_K) {
                    for (int j = 0; j < 4; j++) {
                        for (int i = 0; i < 4; i++) {
                            const int at = 4 * r + i;
                            q[4 * j + i] |= ((o[128 + at] >> (2 * j)) & 3) << 4;
                            q[16 + 4 * j + i] |= ((o[160 + at] >> (2 * j)) & 3) << 4;
                        }
                    }
                    for (int k = 0; k < QK; k++) f[k] = (float)(q[k] - 32);
                    const float d_lo = d * (float)(int8_t)tail[16 + 8 * (2 * s) + r];
                    const float d_hi = d * (float)(int8_t)tail[16 + 8 * (2 * s + 1) + r];
                    affine32(f, d_lo, d_hi, -0.0f, dst);
                    continue;
                }
                if (fmt == DI_FMT_Q5_K) {
                    for (int j = 0; j < 4; j++) {
                        for (int i = 0; i < 4; i++) {
                            const int h = o[128 + 4 * r + i];
                            q[4 * j + i] |= ((h >> j) & 1) << 4;
                            q[16 + 4 * j + i] |= ((h >> (4 + j)) & 1) << 4;
                        }
                    }
                }
                for (int k = 0; k < QK; k++) f[k] = (float)q[k];
                const float D = d * (float)tail[32 + 8 * s + r];
                const float M = half_at(tail + 16 + 2 * r) * (float)tail[96 + 8 * s + r];
                affine32(f, D, D, -M, dst);
            }
        }
    }
}

/* Rows [row0, row0 + rows) of a packed weight (row0 a multiple of 8; rows past N not
   written) as bfloat16, out[rows, K]. -1 for bad arguments. */
int di_int8_unpack_bf16(int fmt, const uint8_t *packed, int N, int K, int row0, int rows,
                        uint16_t *out, int num_threads) {
    if (di_int8_packed_bytes(fmt, N, K) == 0 || row0 < 0 || row0 % GROUP != 0 || rows < 0 ||
        row0 + rows > N)
        return -1;
    const long gbytes = di_int8_packed_bytes(fmt, GROUP, K);
    const int groups = (rows + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int i = 0; i < groups; i++) {
        const int first = i * GROUP;
        const int n = rows - first < GROUP ? rows - first : GROUP;
        unpack_group(fmt, packed + (size_t)(row0 / GROUP + i) * gbytes, n, K,
                     out + (size_t)first * K);
    }
    return 0;
}
