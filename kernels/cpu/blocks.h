/* GGUF's block formats as stored in a file (llama.cpp's ggml-common.h layouts), and what the
   kernels ask of a format: weights and bytes per block, and which widths K it takes.

     Q4_1: 32 weights in 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles (low nibbles: weights
           0-15, high: 16-31); w = d * q + m
     Q8_0: 32 weights in 34 bytes: fp16 d, 32 int8; w = d * q
     Q4_K: 256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc and
           eight 6-bit mins m (one of each per 32 weights), 128 bytes of nibbles (bytes 32p..32p+31
           hold sub-block 2p in their low nibbles, 2p+1 in their high ones);
           w = (d * sc) * q - (dmin * m)
     Q5_K: 256 weights in 176 bytes: Q4_K's header, 32 bytes qh (bit s of qh[i] is the fifth bit
           of weight i of sub-block s), then Q4_K's nibbles; w as Q4_K's with q = 0..31
     Q6_K: 256 weights in 210 bytes: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits),
           sixteen int8 scales (one per 16 weights), fp16 d; w = (d * sc) * (q - 32). Weight
           128h + r: ql[64h + r % 64] >> 4 (r / 64), qh[32h + r % 32] >> 2 (r / 32).
   Every product d * sc, dmin * m and (d * sc) * q is exact in float32 (at most 23 significant
   bits): gguf-py's only rounding is the K-quants' subtraction of the min. */
#ifndef DEEPINFER_BLOCKS_H
#define DEEPINFER_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#include "deepinfer_kernels.h"

typedef struct {
    uint16_t d, m;
    uint8_t qs[DI_QK / 2];
} block_q4_1;

typedef struct {
    uint16_t d;
    int8_t qs[DI_QK];
} block_q8_0;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[DI_QK_K / 2];
} block_q4_k;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[DI_QK_K / 8];
    uint8_t qs[DI_QK_K / 2];
} block_q5_k;

typedef struct {
    uint8_t ql[DI_QK_K / 2];
    uint8_t qh[DI_QK_K / 4];
    int8_t scales[DI_QK_K / 16];
    uint16_t d;
} block_q6_k;

_Static_assert(sizeof(block_q4_1) == 20, "Q4_1 block is 20 bytes");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block is 34 bytes");
_Static_assert(sizeof(block_q4_k) == 144, "Q4_K block is 144 bytes");
_Static_assert(sizeof(block_q5_k) == 176, "Q5_K block is 176 bytes");
_Static_assert(sizeof(block_q6_k) == 210, "Q6_K block is 210 bytes");

/* Weights per block of `fmt`; 0 for a format the kernels do not know. */
static inline int di_block_weights(int fmt) {
    switch (fmt) {
    case DI_FMT_Q4_1:
    case DI_FMT_Q8_0:
        return DI_QK;
    case DI_FMT_Q4_K:
    case DI_FMT_Q5_K:
    case DI_FMT_Q6_K:
        return DI_QK_K;
    default:
        return 0;
    }
}

static inline size_t di_block_bytes(int fmt) {
    switch (fmt) {
    case DI_FMT_Q4_1:
        return sizeof(block_q4_1);
    case DI_FMT_Q8_0:
        return sizeof(block_q8_0);
    case DI_FMT_Q4_K:
        return sizeof(block_q4_k);
    case DI_FMT_Q5_K:
        return sizeof(block_q5_k);
    case DI_FMT_Q6_K:
        return sizeof(block_q6_k);
    default:
        return 0;
    }
}

/* Whether rows K weights long can be stored in `fmt`: a known format, K whole blocks. */
static inline int di_format_ok(int fmt, int K) {
    const int w = di_block_weights(fmt);
    return w > 0 && K > 0 && K % w == 0;
}

/* Bytes of one row of K weights (di_format_ok(fmt, K)). */
static inline size_t di_row_bytes(int fmt, int K) {
    return (size_t)(K / di_block_weights(fmt)) * di_block_bytes(fmt);
}

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j (0-7), from the 12 packed bytes: for
   j < 4 the low 6 bits of bytes j and j + 4; past that, the nibbles of byte j + 4 with the top
   2 bits of bytes j - 4 and j above them. */
static inline void di_k4_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

#endif
