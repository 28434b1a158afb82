"""The bf16 tiles of long prefill products: the unpacked weights are gguf-py's dequantized
values rounded to bf16 (to the bit), the tiled product is torch's bf16 product of them, the
dispatch takes them from `bf16_rows` rows only, and the probe answers from a real child, its
verdict kept for the next start on the same machine."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deepinfer.kernels.linear import bf16_probe, bf16_tiles
from deepinfer.kernels.linear.bf16_probe import Bf16Probe, Bf16Verdict, machine_key, run_probe
from deepinfer.kernels.linear.bf16_tiles import bf16_tiled_linear, unpack_bf16
from deepinfer.kernels.linear.int8_matmul import (
    block_linear,
    int8_linear,
    pack_int8,
    pack_int8_rows,
)
from deepinfer.kernels.linear.quant_matmul import QuantFormat, QuantizedWeight, dequantize_reference
from deepinfer.kernels.native.cpu_native import native_library
from tests.kernels.gguf_weights import K_QUANTS, gguf_weight, kquant_blocks, needs_native

pytestmark = needs_native


def _raw(fmt: QuantFormat, n: int, k: int, seed: int) -> QuantizedWeight:
    """Every quant byte random (K-quants: every scale, min and quant too); Q4_1/Q8_0 scales of
    both signs, Q8_0's -128 included."""
    if fmt in K_QUANTS:
        return QuantizedWeight(fmt, torch.from_numpy(kquant_blocks(fmt, n, k, seed)), k)
    gen = torch.Generator().manual_seed(seed)
    nb = k // 32
    blocks = torch.randint(0, 256, (n, nb, fmt.block_bytes), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, nb, 2, generator=gen) - 0.5).half().view(torch.uint8)  # [n, nb, 4]
    blocks[..., 0:2] = scales[..., 0:2]
    if fmt is QuantFormat.Q4_1:
        blocks[..., 2:4] = scales[..., 2:4]
    return QuantizedWeight(fmt, blocks.reshape(n, -1).contiguous(), k)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("n", [8, 13, 40])
def test_unpacked_rows_are_the_dequantized_weights_in_bf16(fmt: QuantFormat, n: int) -> None:
    """gguf-py's float32 weights rounded to nearest even, bit for bit: random bytes of every
    format (the vectorized Q4_K, Q6_K and Q8_0 paths and the scalar ones), a partial group."""
    k = 2 * fmt.block_weights if fmt in K_QUANTS else 96
    w, want = gguf_weight(fmt, n, k, seed=n)
    got = unpack_bf16(pack_int8(w))
    assert torch.equal(_bits(got), _bits(torch.from_numpy(want).float().to(torch.bfloat16)))
    raw = _raw(fmt, n, k, seed=100 + n)
    ref = dequantize_reference(raw).to(torch.bfloat16)
    assert torch.equal(_bits(unpack_bf16(pack_int8(raw))), _bits(ref))


def test_a_weight_in_two_formats_unpacks_part_by_part() -> None:
    """Q4_K_M's fused q/k (Q4_K) and v (Q6_K) rows come back in order, each in its format."""
    k = 512
    parts = [_raw(QuantFormat.Q4_K, 16, k, 1), _raw(QuantFormat.Q6_K, 11, k, 2)]
    packed = pack_int8_rows(parts)
    want = torch.cat([unpack_bf16(pack_int8(p)) for p in parts])
    assert torch.equal(_bits(unpack_bf16(packed)), _bits(want))


@pytest.mark.parametrize("m", [1, 7, 300])
def test_tiled_product_is_torch_bf16_product(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tile by tile (small tiles: several, a partial last one, a tile across the format
    switch) the product is torch's bf16 matmul of x and the unpacked weight, and close to the
    float32 product (bf16 rounding of x, W and each output)."""
    k = 512
    parts = [_raw(QuantFormat.Q4_K, 24, k, 3), _raw(QuantFormat.Q6_K, 19, k, 4)]
    packed = pack_int8_rows(parts)
    monkeypatch.setattr(bf16_tiles, "TILE_BYTES", 16 * 2 * k)  # 16 rows a tile
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = bf16_tiled_linear(x, packed)
    w = unpack_bf16(packed)
    torch.testing.assert_close(got, (x.to(torch.bfloat16) @ w.t()).float(), rtol=0, atol=0)
    exact = x.double() @ w.double().t()
    assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_block_linear_takes_the_tiles_from_bf16_rows() -> None:
    """Below `bf16_rows` rows (or with 0) the int8 kernel's bits; from it, the tiles'."""
    k = 256
    w = pack_int8(_raw(QuantFormat.Q4_K, 32, k, 5))
    tiled = replace(w, bf16_rows=4)
    for m, want in [(3, int8_linear), (4, bf16_tiled_linear), (9, bf16_tiled_linear)]:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert torch.equal(block_linear(x, tiled), want(x, w))
        assert torch.equal(block_linear(x, w), int8_linear(x, w))


def test_bad_rows_are_refused() -> None:
    w = pack_int8(_raw(QuantFormat.Q8_0, 16, 64, 6))
    out = torch.empty(16, 64, dtype=torch.bfloat16)
    lib, ptr = native_library(), w.packed.data_ptr()
    for row0, rows in [(3, 8), (8, 9), (-8, 8), (0, -1)]:  # unaligned, past N, negative
        with pytest.raises(ValueError, match="rejected"):
            lib.int8_unpack_bf16(1, ptr, 16, 64, row0, rows, out.data_ptr(), 1)


@pytest.mark.slow
def test_the_probe_measures_a_real_child() -> None:
    """The child's rates are real numbers and its bf16 product is right, the tiles are measured
    against the int8 kernel on every format and chosen for those they beat by `TILES_MIN`; a
    child that cannot start (a timeout of nothing) says no, with the reason."""
    verdict = run_probe()
    assert "GFLOP/s" in verdict.said and "relative error" in verdict.said, verdict.said
    assert isinstance(verdict.attention, bool)
    ratios = dict(re.findall(r"(Q\w+) ([0-9.]+)x", verdict.said.split("int8 kernel:")[1]))
    assert set(ratios) == {f.name for f in QuantFormat}, verdict.said
    assert verdict.tiles == {f for f, r in ratios.items() if float(r) >= bf16_probe.TILES_MIN}
    no = run_probe(timeout_s=0.001)
    assert not no.attention and not no.tiles and "did not finish" in no.said


def test_a_verdict_is_kept_for_this_machine_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished probe's verdict is written under this machine's key, and the next probe
    with the same file reads it instead of starting a child; a verdict under another key, a
    broken file or a probe that timed out is not used or kept."""
    runs: list[int] = []
    measured = Bf16Verdict(True, frozenset({"Q6_K"}), "bf16 900 GFLOP/s, float32 100 (9.0x)")

    def fake(timeout_s: float = bf16_probe.TIMEOUT_S) -> Bf16Verdict:
        runs.append(1)
        return measured

    monkeypatch.setattr(bf16_probe, "run_probe", fake)
    verdicts = tmp_path / "machine" / bf16_probe.VERDICT_FILE
    assert Bf16Probe(verdicts).result() == measured
    assert len(runs) == 1 and verdicts.is_file()
    kept = Bf16Probe(verdicts).result()
    assert (kept.attention, kept.tiles) == (True, frozenset({"Q6_K"}))
    assert "9.0x" in kept.said and "kept" in kept.said and len(runs) == 1  # no child this time
    assert bf16_probe.read_verdict(verdicts, machine_key()) is not None
    assert bf16_probe.read_verdict(verdicts, "another machine") is None
    verdicts.write_text("{not json")
    assert Bf16Probe(verdicts).result().attention and len(runs) == 2  # unreadable: probed again
    older = {"key": machine_key(), "fast": True, "said": "an older probe"}
    verdicts.write_text(json.dumps(older))
    assert Bf16Probe(verdicts).result() == measured and len(runs) == 3  # no tiles field: again

    def timed_out(timeout_s: float = bf16_probe.TIMEOUT_S) -> Bf16Verdict:
        return Bf16Verdict(False, said=f"{bf16_probe.NOT_FINISHED}: timed out")

    monkeypatch.setattr(bf16_probe, "run_probe", timed_out)
    other = tmp_path / "other.json"
    assert not Bf16Probe(other).result().attention
    assert not other.exists()
