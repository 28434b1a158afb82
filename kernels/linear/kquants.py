"""GGUF K-quant superblocks (Q4_K, Q5_K, Q6_K) as plain torch fields: the reference arithmetic
of `quant_matmul.block_fields`, unpacked as gguf-py unpacks them (cpu/blocks.h has the layouts).

Each function takes raw superblocks `uint8 [N, S, B]` (S superblocks of 256 weights a row) and
returns float32 (scale [N, G, 1], offset [N, G, 1] or None, q [N, G, 256 / G]) over the G
sub-blocks of the row: a weight is scale * q (+ offset), the two steps gguf-py takes. Q4_K and
Q5_K: G = 8 S, scale d * sc, offset -(dmin * m); Q6_K: G = 16 S, scale d * sc, q - 32.
"""

from __future__ import annotations

import torch

QK_K = 256
"""Weights per K-quant superblock."""


def _fp16(raw: torch.Tensor) -> torch.Tensor:  # uint8 [..., 2] -> float32 [..., 1]
    return raw.contiguous().view(torch.float16).float()


def _shifted(bytes_: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """(bytes_ >> s) & mask for each s, along a new axis before the last: [..., len(shifts), L]."""
    by = torch.tensor(shifts, dtype=torch.uint8).reshape(len(shifts), 1)
    return (bytes_.unsqueeze(-2) >> by) & mask


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in 12 bytes: uint8 [N, S, 12] -> 2 x [N, S, 8]."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k4_fields(
    raw: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's factors for their quants q [N, S, 8, 32]."""
    n, s = raw.shape[:2]
    sc, mn = _scale_min(raw[..., 4:16])
    scale = _fp16(raw[..., 0:2]) * sc.float()  # [N, S, 8], exact
    offset = -(_fp16(raw[..., 2:4]) * mn.float())
    g = s * 8
    return scale.reshape(n, g, 1), offset.reshape(n, g, 1), q.float().reshape(n, g, 32)


def q4_k_fields(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, s = raw.shape[:2]
    qs = raw[..., 16:144].reshape(n, s, 4, 32)  # 32 bytes: sub-blocks 2p (low), 2p + 1 (high)
    return _k4_fields(raw, _shifted(qs, [0, 4], 0x0F).reshape(n, s, 8, 32))


def q5_k_fields(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, s = raw.shape[:2]
    low = _shifted(raw[..., 48:176].reshape(n, s, 4, 32), [0, 4], 0x0F).reshape(n, s, 8, 32)
    fifth = _shifted(raw[..., 16:48], list(range(8)), 0x01)  # [N, S, 8, 32]: bit s of qh[i]
    return _k4_fields(raw, low | (fifth << 4))


def q6_k_fields(raw: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
    n, s = raw.shape[:2]
    ql = _shifted(raw[..., 0:128].reshape(n, s, 2, 64), [0, 4], 0x0F).reshape(n, s, QK_K)
    qh = _shifted(raw[..., 128:192].reshape(n, s, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, s, QK_K)
    q = (ql | (qh << 4)).to(torch.int16) - 32
    scales = raw[..., 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
    scale = _fp16(raw[..., 208:210]) * scales  # exact
    g = s * 16
    return scale.reshape(n, g, 1), None, q.float().reshape(n, g, 16)
