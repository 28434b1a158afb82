/* GGUF blocks to float32 rows, exactly as gguf-py computes them (layouts: cpu/blocks.h), with
   AVX2 and F16C. The float steps are gguf-py's, one by one: a multiply, then the add or the
   subtraction (this file is compiled with -ffp-contract=off), so every value is the reference's
   fp32 weight, bit for bit. The float matmul (cpu/quant_gemm.c) multiplies rows dequantized
   here; `di_dequantize` gives whole matrices (model loading, and long prefill chunks).
*/
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "deepinfer_kernels.h"
#include "parts.h"
#include "simd.h"

/* 8 bytes as float32, unsigned or signed */
static inline __m256 u8_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
static inline __m256 i8_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

/* v >> n in every 16-bit lane, n not a constant */
static inline __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }

/* out[i] = d * q[i] + m for the 16 unsigned bytes in q */
static inline void affine16(__m128i q, __m256 d, __m256 m, float *out) {
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(d, u8_ps(q)), m));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_mul_ps(d, u8_ps(_mm_srli_si128(q, 8))), m));
}

/* out[i] = d * q[i] - m for the 32 unsigned bytes in q (a K-quant sub-block) */
static inline void sub_min32(__m256i q, float d, float m, float *out) {
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int h = 0; h < 2; h++) {
        float *o = out + 16 * h;
        _mm256_storeu_ps(o, _mm256_sub_ps(_mm256_mul_ps(vd, u8_ps(half[h])), vm));
        _mm256_storeu_ps(o + 8,
                         _mm256_sub_ps(_mm256_mul_ps(vd, u8_ps(_mm_srli_si128(half[h], 8))), vm));
    }
}

/* out[i] = d * q[i] for 16 signed bytes in q */
static inline void scale16(__m128i q, float d, float *out) {
    const __m256 vd = _mm256_set1_ps(d);
    _mm256_storeu_ps(out, _mm256_mul_ps(vd, i8_ps(q)));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(vd, i8_ps(_mm_srli_si128(q, 8))));
}

static void dequant_row_q4_1(const block_q4_1 *b, int nb, float *out) {
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    for (int i = 0; i < nb; i++, out += DI_QK) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(b[i].m));
        const __m128i q = _mm_loadu_si128((const __m128i *)b[i].qs);
        affine16(_mm_and_si128(q, low_mask), d, m, out);
        affine16(_mm_and_si128(_mm_srli_epi16(q, 4), low_mask), d, m, out + 16);
    }
}

static void dequant_row_q8_0(const block_q8_0 *b, int nb, float *out) {
    for (int i = 0; i < nb; i++, out += DI_QK) {
        const float d = _cvtsh_ss(b[i].d);
        scale16(_mm_loadu_si128((const __m128i *)b[i].qs), d, out);
        scale16(_mm_loadu_si128((const __m128i *)(b[i].qs + 16)), d, out + 16);
    }
}

/* A Q4_K or Q5_K superblock's per-sub-block factors: d * sc and dmin * m (both exact). */
static inline void k4_factors(uint16_t d16, uint16_t dmin16, const uint8_t *scales, float *dsc,
                              float *dm) {
    const float d = _cvtsh_ss(d16), dmin = _cvtsh_ss(dmin16);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        di_k4_scale_min(scales, j, &sc, &m);
        dsc[j] = d * (float)sc;
        dm[j] = dmin * (float)m;
    }
}

static void dequant_row_q4_k(const block_q4_k *b, int nb, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < nb; i++, out += DI_QK_K) {
        float dsc[8], dm[8];
        k4_factors(b[i].d, b[i].dmin, b[i].scales, dsc, dm);
        for (int p = 0; p < 4; p++) { /* 32 bytes: sub-blocks 2p (low nibbles) and 2p + 1 */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * p));
            sub_min32(_mm256_and_si256(q, low), dsc[2 * p], dm[2 * p], out + 64 * p);
            sub_min32(_mm256_and_si256(_mm256_srli_epi16(q, 4), low), dsc[2 * p + 1],
                      dm[2 * p + 1], out + 64 * p + 32);
        }
    }
}

static void dequant_row_q5_k(const block_q5_k *b, int nb, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    for (int i = 0; i < nb; i++, out += DI_QK_K) {
        float dsc[8], dm[8];
        k4_factors(b[i].d, b[i].dmin, b[i].scales, dsc, dm);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)b[i].qh);
        for (int s = 0; s < 8; s++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * (s / 2)));
            const __m256i lo = _mm256_and_si256(srl16(q, 4 * (s % 2)), low);
            const __m256i bit = _mm256_set1_epi8((char)(1 << s));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            const __m256i hi = _mm256_and_si256(set, fifth);
            sub_min32(_mm256_or_si256(lo, hi), dsc[s], dm[s], out + 32 * s);
        }
    }
}

static void dequant_row_q6_k(const block_q6_k *b, int nb, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    const __m256i offset = _mm256_set1_epi8(32);
    for (int i = 0; i < nb; i++, out += DI_QK_K) {
        const float d = _cvtsh_ss(b[i].d);
        for (int h = 0; h < 2; h++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b[i].qh + 32 * h));
            for (int t = 0; t < 4; t++) { /* weights 128h + 32t .. +31 */
                const uint8_t *l = b[i].ql + 64 * h + 32 * (t % 2);
                const __m256i ql = _mm256_loadu_si256((const __m256i *)l);
                const __m256i lo = _mm256_and_si256(srl16(ql, 4 * (t / 2)), low);
                const __m256i hi = _mm256_and_si256(srl16(qh, 2 * t), two);
                const __m256i q =
                    _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), offset);
                const int g = 8 * h + 2 * t; /* the scales of weights 16g.. and 16(g + 1).. */
                float *o = out + 128 * h + 32 * t;
                scale16(_mm256_castsi256_si128(q), d * (float)b[i].scales[g], o);
                scale16(_mm256_extracti128_si256(q, 1), d * (float)b[i].scales[g + 1], o + 16);
            }
        }
    }
}

void di_dequant_row(int fmt, const uint8_t *row, int K, float *out) {
    switch (fmt) {
    case DI_FMT_Q4_1:
        dequant_row_q4_1((const block_q4_1 *)row, K / DI_QK, out);
        break;
    case DI_FMT_Q8_0:
        dequant_row_q8_0((const block_q8_0 *)row, K / DI_QK, out);
        break;
    case DI_FMT_Q4_K:
        dequant_row_q4_k((const block_q4_k *)row, K / DI_QK_K, out);
        break;
    case DI_FMT_Q5_K:
        dequant_row_q5_k((const block_q5_k *)row, K / DI_QK_K, out);
        break;
    default:
        dequant_row_q6_k((const block_q6_k *)row, K / DI_QK_K, out);
        break;
    }
}

/* The fp32 weights, [N, K]: for long prefill chunks, where a BLAS call on them is faster. */
int di_dequantize(int fmt, const uint8_t *w, float *out, int N, int K, int num_threads) {
    if (!di_format_ok(fmt, K) || N < 0) return -1;
    const size_t rb = di_row_bytes(fmt, K);
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int n = 0; n < N; n++) {
        di_dequant_row(fmt, w + (size_t)n * rb, K, out + (size_t)n * K);
    }
    return 0;
}

/* Q5_0 blocks (fp16 d, 32 fifth bits little-endian, 16 bytes of nibbles; a weight is
   d * (q - 16)) as Q8_0 blocks of the same values: the same d and the int8 q - 16. Exact. */
int di_q5_0_to_q8_0(const uint8_t *src, uint8_t *dst, long nblocks, int num_threads) {
    if (nblocks < 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (long b = 0; b < nblocks; b++) {
        const uint8_t *in = src + b * 22;
        uint8_t *out = dst + b * 34;
        uint32_t fifth;
        memcpy(&fifth, in + 2, 4);
        out[0] = in[0];
        out[1] = in[1];
        for (int i = 0; i < 16; i++) {
            const int lo = (in[6 + i] & 0x0F) | (int)((fifth >> i) & 1) << 4;
            const int hi = (in[6 + i] >> 4) | (int)((fifth >> (i + 16)) & 1) << 4;
            out[2 + i] = (uint8_t)(int8_t)(lo - 16);
            out[18 + i] = (uint8_t)(int8_t)(hi - 16);
        }
    }
    return 0;
}
