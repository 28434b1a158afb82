"""`NullModel`: everything but the model, for measuring the serving path alone.

`--model null` serves the default model's tokenizer and chat format through the whole engine
(API, scheduler, KV blocks and prefix cache, sampler, detokenizer, SSE) with a forward pass that
costs next to nothing: no matrix, no attention, no KV written. Its logits put all the mass on one
token chosen from the input token and its position alone, among the vocabulary's plain lowercase
words, so greedy output is deterministic, different for prompts that end differently or are of
other lengths, and real text (a stream of words, each a single token, as the detokenizer sees
real models' output). `null:PATH` takes another GGUF file's vocabulary instead.

Nothing here depends on the batch: a row's token is a function of its own input token and
position, so the outputs of a request are the same whatever runs beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import threading
from pathlib import Path

import gguf
import torch
from torch import nn

from deepinfer.environment import default_model_path, resolve_model
from deepinfer.errors import ModelLoadError
from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import AttentionBackend
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.kv_layout import KVCaches
from deepinfer.model.loading.gguf_loader import gguf_arch, open_gguf

NULL_MODEL = "null"
"""`--model null` (the default model's vocabulary) or `null:PATH` (a GGUF file's)."""

_WORD = re.compile(rb"^(\xc4\xa0|\xe2\x96\x81)[a-z]{2,9}$")
"""A space-led lowercase word as a byte-level BPE (GPT-2's `Ġ`) or SentencePiece (`▁`) vocabulary
spells it."""

_LOGIT = 30.0
"""The chosen token's logit (every other is 0): greedy picks it, sampling almost always does."""


def is_null_model(path: Path) -> bool:
    text = str(path)
    return text == NULL_MODEL or text.startswith(NULL_MODEL + ":")


def vocabulary_path(path: Path) -> Path:
    """The GGUF file whose vocabulary (and chat format) a null model serves."""
    text = str(path)
    return resolve_model(Path(text[len(NULL_MODEL) + 1 :])) if ":" in text else default_model_path()


def open_null_model(
    path: Path, device: torch.device, backend: AttentionBackend
) -> tuple[NullModel, ModelArch, str, gguf.GGUFReader]:
    """(the model, its one-layer arch, its weights digest, the vocabulary file's reader)."""
    source = vocabulary_path(path)
    if not source.is_file():
        raise ModelLoadError(f"{path}: the vocabulary file {source} does not exist")
    reader = open_gguf(source)
    arch = dataclasses.replace(gguf_arch(reader), num_layers=1, layer_windows=())
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{source} has no vocabulary")
    words = [i for i, part in enumerate(tokens.data) if _WORD.match(bytes(tokens.parts[part]))]
    if len(words) < 2:
        raise ModelLoadError(f"{source}: too few plain words in the vocabulary for a null model")
    digest = hashlib.sha256(f"{NULL_MODEL}:{source.resolve()}".encode()).hexdigest()
    return NullModel(arch, words, device, backend), arch, digest, reader


class NullModel(nn.Module):
    """A `CausalLM` whose forward pass is a table lookup (see the module docstring)."""

    def __init__(
        self, arch: ModelArch, words: list[int], device: torch.device, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.arch = arch
        self.attention_backend = backend
        self.device = device
        self.words = words
        self.kv_caches: KVCaches | None = None
        self._logits = threading.local()
        """Per worker thread: a zeroed [rows, V] buffer and the entries the last step set (the
        sampler never writes logits; zeroing 200 KB a row every step would cost more than the
        rest of the null forward)."""

    # Costing nothing includes the GIL: every torch op drops and retakes it, and each retake
    # can wait for the event loop's thread, so the few rows' arithmetic is done on lists and
    # a step is a handful of ops (a real model's step is one native call or one graph replay).
    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [B_sample, V] float32
        return self.compute_logits(self.forward_hidden(batch))

    def forward_hidden(
        self, batch: ForwardBatch, num_layers: int | None = None
    ) -> torch.Tensor:  # [B_sample, 1]: the next token's index among the words, as a float
        ids, positions = batch.input_ids.tolist(), batch.positions.tolist()
        n = len(self.words)
        index = [
            float((ids[r] * 7919 + positions[r] * 104729 + 17) % n)
            for r in batch.logits_indices.tolist()
        ]
        return torch.tensor(index, dtype=torch.float32, device=self.device).reshape(-1, 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B_sample, V] float32
        """Logits with `_LOGIT` at each row's word, 0 elsewhere: a view of this thread's buffer,
        valid until its next call (the runner samples a step's logits before the next)."""
        rows, vocab = hidden.shape[0], self.arch.vocab_size
        local = self._logits
        buffer: torch.Tensor | None = getattr(local, "buffer", None)
        if buffer is None or buffer.shape[0] < rows:
            buffer = torch.zeros(max(rows, 64), vocab, device=self.device)
            local.buffer, local.flat, local.set = buffer, buffer.view(-1), None
        if local.set is not None:  # clear what the previous step set
            local.flat.index_fill_(0, local.set, 0.0)
        words = self.words
        chosen = [r * vocab + words[int(i)] for r, (i,) in enumerate(hidden.tolist())]
        local.set = torch.tensor(chosen, dtype=torch.int64, device=self.device)
        local.flat.index_fill_(0, local.set, _LOGIT)
        return buffer[:rows]

    def bind_kv_caches(self, kv_caches: KVCaches) -> None:
        self.kv_caches = kv_caches  # never written: nothing reads them back

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.attention_backend = backend
