"""Two builds of the native CPU library, side by side: a decode step's one-row int8 matmuls.

Loads both shared libraries (e.g. a build of the current sources and one of an earlier commit,
from the native build cache, `~/.cache/deepinfer/native`), packs random Q4_1/Q8_0 blocks of
SmolLM2's shapes with each (30 layers' qkv, o, gate/up and down, and the 49152-row LM head),
checks that both give the same bits, then times the step's matmuls, alternating the builds, and
prints each one's median in ms. Run from the repository root:

    python bench/native_ab.py NEW.so OLD.so --rows 1 --threads 2 1
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

LAYER = [(0, 960, 576), (0, 576, 576), (0, 3072, 576), (0, 576, 1536)]  # (fmt, N, K); 0: Q4_1
HEAD = (1, 49152, 576)  # Q8_0


def random_blocks(fmt: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    size = 20 if fmt == 0 else 34
    b = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=gen)
    b[:, :, 0:2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # d ~ 0.008 (float16)
    if fmt == 0:
        b[:, :, 2:4] = torch.tensor([0x00, 0xA0], dtype=torch.uint8)  # m ~ -0.008
    return b.contiguous()


class Build:
    def __init__(self, path: str, mats: list[tuple[int, int, int, torch.Tensor]]) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.di_int8_packed_bytes.restype = ctypes.c_long
        self.packed = []
        for fmt, n, k, blocks in mats:
            out = torch.empty(self.lib.di_int8_packed_bytes(fmt, n, k), dtype=torch.uint8)
            rc = self.lib.di_int8_pack(fmt, _p(blocks), _p(out), n, k, 2)
            assert rc == 0, f"{path}: packing failed"
            self.packed.append((fmt, n, k, out))
        self.megabytes = sum(p[3].numel() for p in self.packed) / 1e6

    def step(self, x: dict[int, torch.Tensor], y: dict[int, torch.Tensor], threads: int) -> float:
        start = time.perf_counter()
        for fmt, n, k, w in self.packed:
            self.lib.di_int8_gemm(fmt, _p(w), _p(x[k]), _p(y[n]), x[k].shape[0], n, k, threads)
        return time.perf_counter() - start


def _p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--reps", type=int, default=20)
    ns = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    mats = [(f, n, k, random_blocks(f, n, k, gen)) for f, n, k in LAYER * 30 + [HEAD]]
    builds = {"new": Build(ns.new, mats), "old": Build(ns.old, mats)}
    x = {k: torch.randn(ns.rows, k, generator=gen) for k in (576, 1536)}
    ys = {name: {n: torch.empty(ns.rows, n) for n in (960, 576, 3072, 49152)} for name in builds}
    for name, b in builds.items():
        b.step(x, ys[name], 2)
    assert all(torch.equal(ys["new"][n], ys["old"][n]) for n in ys["new"]), "the builds differ"
    print({name: f"{b.megabytes:.1f} MB packed" for name, b in builds.items()})
    for threads in ns.threads:
        times: dict[str, list[float]] = {name: [] for name in builds}
        for rep in range(ns.reps):
            for name in ("new", "old") if rep % 2 else ("old", "new"):
                times[name].append(builds[name].step(x, ys[name], threads))
        medians = {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}
        print(f"rows {ns.rows}, threads {threads}: median ms {medians}")


if __name__ == "__main__":
    main()
