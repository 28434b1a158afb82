"""Time each Triton kernel on a CUDA device against the device's measured ceilings.

Run from the repository root: `python -m bench.kernels` (about a minute on an H100-class GPU,
well inside a 15-minute loan). It first checks every kernel against its torch reference on one
mid-sized input, then prints a markdown table: time, achieved bandwidth (memory-bound kernels)
or FLOP rate (matmul, prefill), and that as a fraction of the ceilings measured here: a large
device-to-device copy and a large cuBLAS bf16 matmul.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.kernels.attention import kv_store, paged_attention
from deepinfer.kernels.elementwise import norm, rotary
from deepinfer.kernels.linear import matmul

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Row:
    """One table row: `amount` is bytes moved (kind "GB/s") or FLOPs done (kind "TFLOP/s")."""

    kernel: str
    shape: str
    time_s: float
    amount: float
    kind: str


def time_s(fn: Callable[[], object]) -> float:
    """Median seconds per call, L2 flushed between calls (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")) / 1e3


def ceilings() -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() / time_s(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    flops = 2 * 8192**3 / time_s(lambda: a @ a)
    return copy_bps, flops


def paged_inputs(
    batch: int, context: int, kv_heads: int, dim: int, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of exactly the blocks the batch needs, assigned in random order."""
    per_request = -(-context // block_size)
    num_blocks = batch * per_request
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda").view(batch, per_request).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, lens


def bench_decode(batch: int, context: int, heads: int, kv_heads: int, dim: int) -> Row:
    k_cache, v_cache, tables, lens = paged_inputs(batch, context, kv_heads, dim)
    q = torch.randn(batch, heads, dim, dtype=DTYPE, device="cuda")
    run = lambda: paged_attention.paged_decode_attention(  # noqa: E731
        q, k_cache, v_cache, tables, lens, dim**-0.5, max_context_len=context
    )
    moved = 2 * batch * context * kv_heads * dim * DTYPE.itemsize + 2 * q.numel() * DTYPE.itemsize
    shape = f"B={batch} ctx={context} H={heads}/{kv_heads} D={dim}"
    return Row("paged_decode_attention", shape, time_s(run), moved, "GB/s")


def bench_prefill(batch: int, prefix: int, new: int, heads: int, kv_heads: int, dim: int) -> Row:
    k_cache, v_cache, tables, lens = paged_inputs(batch, prefix + new, kv_heads, dim)
    q = torch.randn(batch * new, heads, dim, dtype=DTYPE, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * new
    run = lambda: paged_attention.paged_prefill_attention(  # noqa: E731
        q, k_cache, v_cache, tables, starts, lens, dim**-0.5, max_query_len=new
    )
    visible_keys = batch * sum(prefix + i + 1 for i in range(new))
    flops = 4 * heads * dim * visible_keys  # QK^T and PV
    shape = f"B={batch} prefix={prefix} new={new} H={heads}/{kv_heads} D={dim}"
    return Row("paged_prefill_attention", shape, time_s(run), flops, "TFLOP/s")


def bench_elementwise() -> list[Row]:
    tokens, hidden = 16384, 4096
    x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
    residual, weight = torch.randn_like(x), torch.rand(hidden, dtype=DTYPE, device="cuda")
    size = x.numel() * DTYPE.itemsize
    rows = [
        Row(
            "rms_norm",
            f"T={tokens} D={hidden}",
            time_s(lambda: norm.rms_norm(x, weight, 1e-5)),
            2 * size,
            "GB/s",
        ),
        Row(
            "fused_add_rms_norm",
            f"T={tokens} D={hidden}",
            time_s(lambda: norm.fused_add_rms_norm(x, residual, weight, 1e-5)),
            4 * size,
            "GB/s",
        ),
    ]
    q = torch.randn(tokens, 32, 128, dtype=DTYPE, device="cuda")
    k = torch.randn(tokens, 8, 128, dtype=DTYPE, device="cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos_sin = rotary.rotary_cos_sin(128, 8192, 1e6, "cuda")
    rotate = lambda: rotary.apply_rotary(q, k, positions, cos_sin)  # noqa: E731
    qk_bytes = 2 * (q.numel() + k.numel()) * DTYPE.itemsize
    rows.append(Row("apply_rotary", f"T={tokens} H=32/8 D=128", time_s(rotate), qk_bytes, "GB/s"))
    k_cache, v_cache, _, _ = paged_inputs(tokens // 16, 16, 8, 128)
    slots = torch.randperm(tokens, device="cuda")
    store = lambda: kv_store.store_kv(k, k, k_cache, v_cache, slots)  # noqa: E731
    rows.append(
        Row("store_kv", f"T={tokens} Hkv=8 D=128", time_s(store), 4 * k.numel() * 2, "GB/s")
    )
    return rows


def bench_matmul(m: int, k: int, n: int) -> Row:
    a = torch.randn(m, k, dtype=DTYPE, device="cuda")
    w = torch.randn(n, k, dtype=DTYPE, device="cuda")
    run = lambda: matmul.matmul(a, w.t())  # noqa: E731
    return Row("matmul", f"M={m} K={k} N={n}", time_s(run), 2 * m * n * k, "TFLOP/s")


def verify() -> list[str]:
    """Kernel vs reference on the GPU, one mid-sized case each; returns the failures."""
    failures: list[str] = []

    def close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        if not torch.allclose(actual.float(), expected.float(), atol=3e-2, rtol=3e-2):
            err = (actual.float() - expected.float()).abs().max().item()
            failures.append(f"{name}: max abs error {err:.3g}")

    k_cache, v_cache, tables, lens = paged_inputs(8, 700, 3, 64)
    lens = torch.tensor([1, 15, 16, 17, 300, 513, 699, 700], dtype=torch.int32, device="cuda")
    q = torch.randn(8, 9, 64, dtype=DTYPE, device="cuda")
    args = (q, k_cache, v_cache, tables, lens, 0.125)
    close(
        "decode",
        paged_attention.paged_decode_attention(*args),
        paged_attention.paged_decode_attention_reference(*args),
    )
    starts = torch.tensor([0, 1, 3, 3, 20, 90, 91, 150, 230], dtype=torch.int32, device="cuda")
    q = torch.randn(230, 9, 64, dtype=DTYPE, device="cuda")
    prefill_args = (q, k_cache, v_cache, tables, starts, lens, 0.125)
    close(
        "prefill",
        paged_attention.paged_prefill_attention(*prefill_args),
        paged_attention.paged_prefill_attention_reference(*prefill_args),
    )
    a, b = (
        torch.randn(300, 576, dtype=DTYPE, device="cuda") / 24,
        torch.randn(1536, 576, dtype=DTYPE, device="cuda"),
    )
    close("matmul", matmul.matmul(a, b.t()), a.float() @ b.float().t())
    x, r = (torch.randn(33, 576, dtype=DTYPE, device="cuda") for _ in range(2))
    w = torch.rand(576, dtype=DTYPE, device="cuda") + 0.5
    close(
        "fused_add_rms_norm",
        norm.fused_add_rms_norm(x, r, w, 1e-5)[0],
        norm.fused_add_rms_norm_reference(x, r, w, 1e-5)[0],
    )
    q, k = (
        torch.randn(33, 9, 64, dtype=DTYPE, device="cuda"),
        torch.randn(33, 3, 64, dtype=DTYPE, device="cuda"),
    )
    positions, cos_sin = torch.arange(33, device="cuda"), rotary.rotary_cos_sin(64, 64, 1e5, "cuda")
    q2, k2 = q.clone(), k.clone()
    rotary.apply_rotary(q, k, positions, cos_sin)
    rotary.apply_rotary_reference(q2, k2, positions, cos_sin)
    close("apply_rotary", torch.cat([q, k], 1), torch.cat([q2, k2], 1))
    slots = torch.randperm(k_cache.shape[0] * 16, device="cuda")[:33]
    kc, vc, kc2, vc2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    kv_store.store_kv(k, k, kc, vc, slots)
    kv_store.store_kv_reference(k, k, kc2, vc2, slots)
    close("store_kv", kc, kc2)
    return failures


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA device; none is visible, so nothing was timed.")
        return 2
    torch.manual_seed(0)
    failures = verify()
    print("correctness vs torch reference:", "all ok" if not failures else "; ".join(failures))
    copy_bps, matmul_flops = ceilings()
    rows = [
        bench_decode(256, 2048, 32, 8, 128),
        bench_decode(256, 1024, 9, 3, 64),
        bench_decode(8, 8192, 32, 8, 128),
        bench_prefill(4, 1024, 1024, 32, 8, 128),
        *bench_elementwise(),
        bench_matmul(4096, 4096, 4096),
        bench_matmul(256, 4096, 14336),
    ]
    print(f"\n{torch.cuda.get_device_name()}: copy {copy_bps / 1e9:.0f} GB/s, "
          f"bf16 matmul {matmul_flops / 1e12:.0f} TFLOP/s\n")  # fmt: skip
    print("| kernel | shape | time (us) | achieved | of ceiling |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        rate = row.amount / row.time_s
        ceiling = copy_bps if row.kind == "GB/s" else matmul_flops
        scaled = rate / (1e9 if row.kind == "GB/s" else 1e12)
        print(f"| {row.kernel} | {row.shape} | {row.time_s * 1e6:.1f} | "
              f"{scaled:.1f} {row.kind} | {rate / ceiling:.0%} |")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
