"""Is int8 activation arithmetic acceptable? Perplexity of deepinfer's float32 and int8 matmul
activations on a local text, llama.cpp's `llama-perplexity` on the same file, and the KL
divergence of int8 from float32 over the same windows.

The text is cut into non-overlapping windows of `--ctx` tokens as llama-perplexity cuts it (BOS
first where the vocabulary adds one); each window is one prefill and its second half is scored:
the logits at positions ctx/2 .. ctx-2 predict the tokens after them. Run from the repository
root (no network; the text defaults to the GPL-3 licence shipped with the OS):

    python bench/perplexity.py --ctx 512
    python bench/perplexity.py --text /usr/share/common-licenses/GPL-3 --ctx 512 --skip-llama

With llama-perplexity found, deepinfer float32's log-probabilities are also written in its
`--kl-divergence-base` format and llama.cpp is run with `--kl-divergence` on the same tokens:
its KL divergence from our float32, and its perplexity on our tokenization.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from common import find_llama_binary, provenance

from deepinfer.environment import default_model_path, resolve_model
from deepinfer.model.forward_batch import BatchChunk, build_forward_batch
from deepinfer.model.kv_layout import allocate_kv_caches
from deepinfer.model.loading.gguf_loader import gguf_arch, open_gguf
from deepinfer.model.loading.loader import load_model
from deepinfer.model.protocol import CausalLM
from deepinfer.text.tokenizer import Tokenizer

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
BLOCK_SIZE = 16


def windows(tokens: list[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """Non-overlapping windows of `ctx` tokens, the first replaced by BOS when one is added
    (llama-perplexity's chunks)."""
    out = [tokens[i * ctx : (i + 1) * ctx] for i in range(len(tokens) // ctx)]
    return [[bos_id, *w[1:]] if bos_id is not None else w for w in out]


def scored_logits(model: CausalLM, window: list[int], first: int) -> torch.Tensor:
    """Logits `[ctx - 1 - first, V]` at positions first .. ctx-2 after one prefill of `window`."""
    blocks = list(range(1, -(-len(window) // BLOCK_SIZE) + 1))
    batch = build_forward_batch([BatchChunk(window, 0, blocks)], BLOCK_SIZE)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(first, len(window) - 1))
    with torch.inference_mode():
        return model(batch).float()


@dataclass
class Scores:
    """Per scored token: the negative log-likelihood under each model, and int8's divergence."""

    nll_float: list[float] = field(default_factory=list)
    nll_int8: list[float] = field(default_factory=list)
    kld: list[float] = field(default_factory=list)
    same_top: list[bool] = field(default_factory=list)
    int8_name: str = "int8"
    """The second arithmetic: int8, with long products as bf16 tiles where they served."""

    def add(self, base: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> None:
        logp = torch.log_softmax(base.double(), -1)  # [R, V]
        logq = torch.log_softmax(other.double(), -1)
        picked = targets[:, None]
        self.nll_float += (-logp.gather(1, picked)[:, 0]).tolist()
        self.nll_int8 += (-logq.gather(1, picked)[:, 0]).tolist()
        self.kld += (logp.exp() * (logp - logq)).sum(-1).tolist()
        self.same_top += (base.argmax(-1) == other.argmax(-1)).tolist()


def perplexity(nll: list[float]) -> tuple[float, float]:
    """exp(mean NLL) and its one-sigma uncertainty (llama-perplexity's estimate)."""
    values = np.asarray(nll)
    mean = float(values.mean())
    sigma = float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0
    return float(np.exp(mean)), float(np.exp(mean) * sigma)


def kl_base_rows(logits: torch.Tensor, nv: int) -> np.ndarray:
    """llama-perplexity's base log-probability rows (`log_softmax` in perplexity.cpp): per row,
    float32 scale and min log-prob, then each logit within 16 of the max as a uint16 step."""
    x = logits.float().numpy()
    top = x.max(1, keepdims=True)
    low = np.maximum(x.min(1, keepdims=True), top - 16)
    log_sum_exp = np.log(np.exp((x - top).astype(np.float64)).sum(1, keepdims=True))
    min_log_prob = (low - top - log_sum_exp.astype(np.float32)).astype(np.float32)
    scale = ((top - low) / np.float32(65535.0)).astype(np.float32)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    steps = np.where(x > low, np.rint(inv * (x - low)), 0).astype(np.uint16)
    rows = np.zeros((x.shape[0], nv), dtype=np.uint16)
    header = np.concatenate([scale, min_log_prob], axis=1).astype(np.float32)
    rows[:, :4] = header.view(np.uint16)
    rows[:, 4 : 4 + x.shape[1]] = steps
    return rows


def write_kl_header(out: BinaryIO, ctx: int, vocab: int, chunks: list[list[int]]) -> None:
    out.write(b"_logits_")
    out.write(np.array([ctx], dtype=np.uint32).tobytes())
    out.write(np.array([vocab, len(chunks)], dtype=np.int32).tobytes())
    out.write(np.asarray(chunks, dtype=np.int32).tobytes())


def _llama_run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    return float(found.group(1)) if found else float("nan")


def llama_perplexity(binary: Path, model: Path, text: Path, ctx: int) -> dict[str, float]:
    threads = str(os.cpu_count() or 2)
    log = _llama_run([str(binary), "-m", str(model), "-f", str(text), "-c", str(ctx),
                      "-t", threads, "-tb", threads])  # fmt: skip
    return {
        "ppl": _number(r"Final estimate: PPL = ([\d.]+)", log),
        "ppl_err": _number(r"Final estimate: PPL = [\d.]+ \+/- ([\d.]+)", log),
        "chunks": _number(r"calculating perplexity over (\d+) chunks", log),
    }


def llama_kl(binary: Path, model: Path, base: Path, ctx: int) -> dict[str, float]:
    threads = str(os.cpu_count() or 2)
    log = _llama_run([str(binary), "-m", str(model), "--kl-divergence-base", str(base),
                      "--kl-divergence", "-c", str(ctx), "-t", threads, "-tb", threads])  # fmt: skip
    return {
        "ppl_q": _number(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log),
        "ppl_base": _number(r"Mean PPL\(base\)\s*:\s*([\d.]+)", log),
        "kld_mean": _number(r"Mean\s+KLD:\s*([-\d.]+)", log),
        "kld_p99": _number(r"99\.0%\s+KLD:\s*([-\d.]+)", log),
        "same_top": _number(r"Same top p:\s*([\d.]+)", log),
    }


def score(
    model_path: Path,
    chunks: list[list[int]],
    kv_dtype: torch.dtype,
    bases: dict[str, BinaryIO],
    bf16_prefill: str = "auto",
) -> Scores:
    """Both arithmetics over every window; each one's rows go to `bases[name]` when given.
    int8 takes `bf16_prefill` as the server does (`auto`: its bf16 tiles where the probe
    passes; a window is one product of `ctx` rows, so they serve it from 256)."""
    models = {
        "float32": load_model(model_path, torch.float32, "cpu"),
        "int8": load_model(
            model_path, torch.float32, "cpu", matmul_activations="int8", bf16_prefill=bf16_prefill
        ),
    }
    for loaded in models.values():
        num_blocks = -(-len(chunks[0]) // BLOCK_SIZE) + 1
        caches = allocate_kv_caches(loaded.arch, num_blocks, BLOCK_SIZE, kv_dtype, "cpu")
        loaded.model.bind_kv_caches(caches)
    scores = Scores(int8_name="int8 + bf16 tiles" if models["int8"].bf16_prefill else "int8")
    for i, window in enumerate(chunks):
        first = len(window) // 2
        logits = {name: scored_logits(m.model, window, first) for name, m in models.items()}
        scores.add(logits["float32"], logits["int8"], torch.tensor(window[first + 1 :]))
        for name, out in bases.items():
            nv = 2 * ((logits[name].shape[1] + 1) // 2) + 4
            out.write(kl_base_rows(logits[name], nv).tobytes())
        print(f"  window {i + 1}/{len(chunks)}: float32 PPL so far "
              f"{perplexity(scores.nll_float)[0]:.4f}", flush=True)  # fmt: skip
    return scores


@dataclass
class Llama:
    """llama-perplexity's own run on the text, and its `--kl-divergence` runs per base."""

    ppl: dict[str, float] = field(default_factory=dict)
    kl: dict[str, dict[str, float]] = field(default_factory=dict)


def report(
    ns: argparse.Namespace, tokens: int, num_windows: int, scores: Scores, llama: Llama
) -> Iterator[str]:
    yield f"### Perplexity: {ns.text} (ctx {ns.ctx}, deepinfer KV {ns.kv_dtype})"
    yield ""
    yield provenance()
    yield ""
    yield (f"{tokens} tokens (deepinfer's tokenizer), {num_windows} "
           f"windows of {ns.ctx}, {len(scores.kld)} scored tokens (the second half of each window).")  # fmt: skip
    yield ""
    yield "| engine | PPL | +/- |"
    yield "|---|---|---|"
    for name, nll in (
        ("deepinfer float32", scores.nll_float),
        (f"deepinfer {scores.int8_name}", scores.nll_int8),
    ):
        ppl, err = perplexity(nll)
        yield f"| {name} | {ppl:.4f} | {err:.4f} |"
    if llama.ppl:
        yield (f"| llama.cpp `llama-perplexity` (its own tokenization: {llama.ppl['chunks']:.0f} "
               f"chunks) | {llama.ppl['ppl']:.4f} | {llama.ppl['ppl_err']:.4f} |")  # fmt: skip
    if "float32" in llama.kl:
        yield f"| llama.cpp on deepinfer's tokens | {llama.kl['float32']['ppl_q']:.4f} | |"
    yield ""
    kld = np.asarray(scores.kld)
    yield "| KL divergence | mean | p99 | same top-1 % |"
    yield "|---|---|---|---|"
    yield (f"| deepinfer {scores.int8_name} from deepinfer float32 | {kld.mean():.6f} | "
           f"{np.percentile(kld, 99):.6f} | {100 * np.mean(scores.same_top):.2f} |")  # fmt: skip
    for base, kl in llama.kl.items():
        yield (f"| llama.cpp from deepinfer {base} (`--kl-divergence`; base PPL read back "
               f"{kl['ppl_base']:.4f}) | {kl['kld_mean']:.6f} | {kl['kld_p99']:.6f} | "
               f"{kl['same_top']:.2f} |")  # fmt: skip


def run_llama(
    binary: Path, ns: argparse.Namespace, model_path: Path, bases: dict[str, Path]
) -> Llama:
    llama = Llama(
        kl={name: llama_kl(binary, model_path, path, ns.ctx) for name, path in bases.items()}
    )
    if not ns.max_windows:  # llama-perplexity scores the whole text
        llama.ppl = llama_perplexity(binary, model_path, ns.text, ns.ctx)
    return llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--kv-dtype", choices=["float16", "float32"], default="float16",
                    help="deepinfer's KV cache (float16: the CPU default, as llama.cpp's f16)")  # fmt: skip
    ap.add_argument("--max-windows", type=int, default=0, help="0: every window")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--bf16-prefill", choices=["auto", "on", "off"], default="auto",
                    help="int8's long products as bf16 tiles, as the server's flag")  # fmt: skip
    ap.add_argument("--model", default=None, help="a GGUF file or a pulled model's name")
    ns = ap.parse_args()
    model_path = resolve_model(Path(ns.model)) if ns.model else default_model_path()
    reader = open_gguf(model_path)
    tokenizer, vocab_size = Tokenizer.from_gguf(reader), gguf_arch(reader).vocab_size
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    tokens = ([bos] if bos is not None else []) + tokenizer.encode(ns.text.read_text())
    chunks = windows(tokens, ns.ctx, bos)[: ns.max_windows or None]
    if not chunks:
        raise SystemExit(f"{ns.text} has {len(tokens)} tokens: fewer than one window")
    binary = None if ns.skip_llama else find_llama_binary("llama-perplexity")
    if binary is None and not ns.skip_llama:
        print("llama-perplexity not found (set LLAMA_BIN_DIR or build it): skipped")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        paths = {n: Path(tmp) / f"{n}.kld" for n in ("float32", "int8")} if binary else {}
        bases: dict[str, BinaryIO] = {
            n: stack.enter_context(p.open("wb")) for n, p in paths.items()
        }
        for out in bases.values():
            write_kl_header(out, ns.ctx, vocab_size, chunks)
        scores = score(model_path, chunks, getattr(torch, ns.kv_dtype), bases, ns.bf16_prefill)
        stack.close()
        llama = run_llama(binary, ns, model_path, paths) if binary else Llama()
    print("\n".join(report(ns, len(tokens), len(chunks), scores, llama)))


if __name__ == "__main__":
    main()
