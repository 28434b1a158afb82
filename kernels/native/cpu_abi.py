"""The native kernels' C ABI (`cpu/deepinfer_kernels.h`) mirrored in ctypes.

`FUNCTIONS` holds every exported function's (restype, argtypes) and each `ctypes.Structure`
here one struct of the header, fields in its order. tests/kernels/native/test_cpu_abi.py parses the
header and checks every entry against it (and each struct's size against the library's
`di_sizeof_*`), so a prototype changed on one side only fails a test instead of corrupting
arguments. Pointers to a struct are typed as such; every other pointer is a `c_void_p` that
callers fill with a tensor's `data_ptr()`.
"""

from __future__ import annotations

import ctypes
from typing import Any

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class RmsNormArgs(ctypes.Structure):
    """di_rms_norm_args: residual and summed are 0 (NULL) for a plain RMSNorm."""

    _fields_ = [
        ("x", _p), ("x_stride", _l), ("residual", _p), ("residual_stride", _l), ("w", _p),
        ("out", _p), ("out_stride", _l), ("summed", _p), ("summed_stride", _l), ("T", _i),
        ("D", _i), ("eps", _f), ("num_threads", _i),
    ]  # fmt: skip


class AttentionArgs(ctypes.Structure):
    """di_attention_args: paged decode attention, one query row per request."""

    _fields_ = [
        ("q", _p), ("q_stride_b", _l), ("q_stride_h", _l), ("k_cache", _p), ("v_cache", _p),
        ("block_tables", _p), ("max_blocks", _i), ("context_lens", _p), ("out", _p), ("B", _i),
        ("H", _i), ("Hkv", _i), ("D", _i), ("S", _i), ("scale", _f), ("num_threads", _i),
        ("kv_f16", _i), ("window", _i),
    ]  # fmt: skip


class Matrix(ctypes.Structure):
    """di_matrix: GGUF blocks (int8 == 0) or int8-repacked groups (int8 == 1), the last N2 rows
    of an int8 one in fmt2 (N2 == 0: one format)."""

    _fields_ = [
        ("data", _p), ("fmt", _i), ("int8", _i), ("N", _i), ("K", _i), ("fmt2", _i), ("N2", _i),
    ]  # fmt: skip


class LlamaLayer(ctypes.Structure):
    """di_llama_layer: one decoder layer's weights, RoPE table, window, activation and KV
    caches; the optional norms are 0 (NULL) where the layer has none."""

    _fields_ = [
        ("qkv", Matrix), ("o", Matrix), ("gate_up", Matrix), ("down", Matrix),
        ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
        ("attn_out_norm", _p), ("mlp_out_norm", _p), ("cos_sin", _p), ("window", _i),
        ("activation", _i), ("k_cache", _p), ("v_cache", _p), ("qkv_bias", _p),
    ]  # fmt: skip


class LlamaStep(ctypes.Structure):
    """di_llama_step: what one step of the stack shares across layers; the window_* fields
    address the sliding-window layers' own KV pool, window_slots 0 (NULL) for one pool."""

    _fields_ = [
        ("T", _i), ("hidden", _i), ("H", _i), ("Hkv", _i), ("head_dim", _i), ("intermediate", _i),
        ("eps", _f), ("scale", _f), ("positions", _p), ("num_positions", _l),
        ("slots", _p), ("num_slots", _l), ("block_tables", _p), ("max_blocks", _i),
        ("context_lens", _p), ("block_size", _i), ("kv_f16", _i), ("num_threads", _i),
        ("window_slots", _p), ("window_num_slots", _l), ("window_block_tables", _p),
        ("window_max_blocks", _i),
    ]  # fmt: skip


STRUCTS: dict[str, type[ctypes.Structure]] = {
    "di_rms_norm_args": RmsNormArgs,
    "di_attention_args": AttentionArgs,
    "di_matrix": Matrix,
    "di_llama_layer": LlamaLayer,
    "di_llama_step": LlamaStep,
}
"""Each header struct's mirror, by its C name."""

_gemm = (_i, _p, _p, _p, _i, _i, _i, _i)  # fmt, w, x, y, M, N, K, num_threads

FUNCTIONS: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "di_quant_gemm": (_i, _gemm),
    "di_dequantize": (_i, (_i, _p, _p, _i, _i, _i)),
    "di_q5_0_to_q8_0": (_i, (_p, _p, _l, _i)),
    "di_int8_packed_bytes": (_l, (_i, _i, _i)),
    "di_int8_pack": (_i, (_i, _p, _p, _i, _i, _i)),
    "di_int8_gemm": (_i, _gemm),
    "di_int8_split_packed_bytes": (_l, (_i, _i, _i, _i, _i)),
    "di_int8_gemm_split": (_i, (_i, _i, _i, _p, _p, _p, _i, _i, _i, _i)),
    "di_int8_gemm_acc": (_i, (_i, _i, _i, _p, _p, _p, _i, _i, _i, _i)),
    "di_int8_unpack_bf16": (_i, (_i, _p, _i, _i, _i, _i, _p, _i)),
    "di_int8_isa": (_i, (_i,)),
    "di_int8_pairs": (_i, (_i,)),
    "di_rms_norm": (_i, (ctypes.POINTER(RmsNormArgs),)),
    "di_rotary": (_i, (_p, _l, _i, _p, _l, _i, _p, _p, _l, _i, _i, _i)),
    "di_store_kv": (_i, (_p, _l, _p, _l, _p, _p, _l, _p, _i, _i, _i)),
    "di_silu_mul": (_i, (_p, _l, _p, _l, _i, _i, _i)),
    "di_gelu_tanh_mul": (_i, (_p, _l, _p, _l, _i, _i, _i)),
    "di_argmax_rows": (_i, (_p, _l, _i, _i, _p, _i)),
    "di_paged_decode_attention": (_i, (ctypes.POINTER(AttentionArgs),)),
    "di_llama_layers": (
        _i,
        (ctypes.POINTER(LlamaLayer), _i, ctypes.POINTER(LlamaStep), _p, _p, _i),
    ),
    "di_moe_experts": (
        _i,
        (ctypes.POINTER(Matrix), ctypes.POINTER(Matrix), _i, _i, _p, _p, _p, _p, _i, _i, _i),
    ),
    **{f"di_sizeof_{name.removeprefix('di_')}": (_l, ()) for name in STRUCTS},
}
"""Every exported function's (restype, argtypes), by name."""


def declare(lib: ctypes.CDLL) -> None:
    """Set every exported function's signature on the loaded library."""
    for name, (restype, argtypes) in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = list(argtypes)
