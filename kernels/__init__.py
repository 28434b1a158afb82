"""deepinfer's compute kernels, imported as `deepinfer.kernels` (never as a top-level `kernels`).

One family per module, the modules grouped by concept: `attention/`, `linear/`, `elementwise/`,
`moe/`, `layers/` (the native decoder stack) and `native/` (the native kernels' build, load and
ABI). Each family has a plain-torch `*_reference` function (the CPU path and
the tests' oracle) and a Triton launcher of the same name without `_reference`, which checks
shapes, dtypes and strides (raising `KernelInputError`) and raises `KernelUnsupportedError` for
valid input it does not cover; `run_or_fallback` turns the latter into the reference plus one log
line. The references live in Triton-free modules (`elementwise.norm_torch`,
`elementwise.rotary_torch`, `attention.kv_store_torch`, `attention.paged_attention_torch` with its
per-step `PagedAttentionPlan`, `elementwise.activation`), the launchers in `elementwise.norm`,
`elementwise.rotary`, `attention.kv_store`, `linear.matmul` and `attention.paged_attention`
(kernels in `attention.paged_attention_kernels`), which re-export their references. `dispatch`
holds the shared checks.

Only the launcher modules load Triton (through `triton_common`), and only the `triton` backend
and the kernel tests import them: this package, `dispatch`, the references and the native CPU
kernels never do, so the CPU path runs without Triton loaded. This package imports torch,
triton, its own modules and the stdlib-only `deepinfer.environment` (for its `DEEPINFER_NATIVE*`
switches), relatively.

Native CPU kernels (C with AVX2 intrinsics, `cpu/*.c`; their ABI is `cpu/deepinfer_kernels.h`,
mirrored in ctypes by `native.cpu_abi`) are built and loaded by `native.cpu_native`:
`linear.quant_matmul` (linear layers over GGUF Q4_1/Q8_0/K-quant blocks) and
`attention.paged_attention_cpu` (the `cpu` backend's decode attention, reading the paged caches
directly).

KV layout (shared by every attention kernel): per layer, `k_cache` and `v_cache` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`. A token's slot is
`block_id * block_size + offset_in_block`. Block tables are `int32 [B, max_blocks]`, padded with 0.

On CPU tensors the Triton kernels run only under `TRITON_INTERPRET=1`, set before the launcher
modules are imported (Triton chooses interpreter or compiler per kernel at import).
"""

from .dispatch import (
    KernelInputError,
    KernelUnsupportedError,
    run_or_fallback,
    triton_available,
)

__all__ = ["KernelInputError", "KernelUnsupportedError", "run_or_fallback", "triton_available"]
