/* What the int8-activation matmul's files share (cpu/int8_gemm.c: the legacy formats, x's
   quantization and the driver; cpu/int8_kquants.c: the K-quants): the group size, the row
   counts of a pass, the helpers a pass reads its weights with, and a pass's signature. */
#ifndef DEEPINFER_INT8_H
#define DEEPINFER_INT8_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "deepinfer_kernels.h"
#include "parts.h"

#define GROUP 8   /* weight rows repacked together: one float lane each */
#define MR 4      /* the most rows of x an AVX2 pass takes */
#define MR_VNNI 8 /* the most rows of x an AVX-512 VNNI pass takes */
/* How far ahead of the block being read a one-row pass asks for the weights (2 KiB, or into L2
   only, measured the same). With the float16 scales, a decode step's one-row matmuls are 11-13%
   faster on 2 threads than before both (bench/native_ab.py, bench/RESULTS.md). */
#define PREFETCH_AHEAD 1024

#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

/* A group block `bytes` long, PREFETCH_AHEAD bytes past `g`, into the caches: the first pass over
   a group (the only one when x has at most MR rows) streams the weight from memory. */
static inline void prefetch_block(const uint8_t *g, int bytes) {
    for (int o = 0; o < bytes; o += 64) {
        _mm_prefetch((const char *)(g + PREFETCH_AHEAD + o), _MM_HINT_T0);
    }
}

/* 8 float16 scales at `p` as float32 (exact) */
static inline __m256 scales8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 4 bytes at `p` in every 32-bit lane */
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One pass: a group of GROUP weight rows (packed from `g`, nb blocks of 32 weights) times R
   quantized rows of x (`q` rows K apart, `dx`/`sx` rows nb apart); acc[c] lane r = y[c, r].
   `pf`: prefetch the weights ahead (the first pass over a group). */
typedef void (*group_fn)(const uint8_t *g, int nb, const int8_t *q, const float *dx,
                         const float *sx, int K, int pf, __m256 *acc);

/* int8_kquants.c: the K-quant formats' packing (rows <= GROUP rows of K weights in GGUF blocks
   to one group, di_int8_kquant_group_bytes(fmt, K) bytes) and passes (rows 1..MR, or 1..MR_VNNI
   with `vnni`). */
DI_INTERNAL long di_int8_kquant_group_bytes(int fmt, int K);
DI_INTERNAL void di_int8_kquant_pack(int fmt, const uint8_t *w, int rows, int K, uint8_t *out);
DI_INTERNAL group_fn di_int8_kquant_pass(int fmt, int vnni, int rows);

/* A VNNI pass over two adjacent groups (g2 = the next group) in 512-bit vectors: acc[c] lanes
   0-7 are the first group's y[c, r], 8-15 the second's; the same bits as two group_fn passes.
   di_int8_kquant_pair_pass: the K-quants' (rows 1..MR_VNNI), NULL for other formats. */
typedef void (*pair_fn)(const uint8_t *g, const uint8_t *g2, int nb, const int8_t *q,
                        const float *dx, const float *sx, int K, int pf, __m512 *acc);
DI_INTERNAL pair_fn di_int8_kquant_pair_pass(int fmt, int rows);

#endif
