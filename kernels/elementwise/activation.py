"""The gated MLP's activation over one fused gate/up projection: silu(gate) * up (Llama),
gelu_tanh(gate) * up (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
