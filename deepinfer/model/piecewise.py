"""A model's forward cut at attention: the pieces between two attention calls run on static
buffers, attention runs eagerly between them on the step's own batch.

This is what prefill CUDA graphs capture (`runner/prefill_graphs.py`, one set of pieces per
token-count bucket): a prefill step is then L + 1 graph replays and L attention calls instead
of a dozen or more launches a layer, each of which drops and retakes the GIL. Attention stays
out of the graphs because its work depends on the step's requests (their contexts, block
tables and query starts), which a token count does not fix; everything else in a layer is row
by row.

Piece 0 embeds the tokens and projects layer 0's q, k and v; piece i (1..L-1) finishes layer
i - 1 from its attention output and projects layer i's; piece L finishes the last layer. A piece
reads and writes only the static buffers (token ids, positions, q/k/v, the attention output,
the residual stream, the last hidden state), so a graph captured on them replays the same work
on whatever `load` wrote. Rows past the step's tokens are padding: every op of a piece is row by
row, so they touch no real row, and attention, run on the real rows alone, never sees them (they
write no KV).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.llama_layers import DecoderLayer, paged_attention
from deepinfer.model.step_context import StepContext

Replay = Callable[[int], None]
"""Runs piece `i` of the current token bucket (a graph's replay, or the piece itself)."""


class PiecewiseForward:
    """The pieces of `model`'s forward for up to `max_tokens` tokens, and a forward made of them.

    Construction runs every piece once at `max_tokens` (outside any capture: it allocates the
    static buffers, and on a GPU compiles the pieces' kernels)."""

    def __init__(self, model: LlamaForCausalLM, max_tokens: int, device: torch.device) -> None:
        if model.kv_caches is None:
            raise ValueError("bind the model's KV caches first")
        self.model = model
        self.max_tokens = max_tokens
        self.layers: list[DecoderLayer] = [cast(DecoderLayer, layer) for layer in model.layers]
        self.num_layers = len(self.layers)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._buffers: dict[str, torch.Tensor] = {}
        self._steps: dict[int, StepContext] = {}
        for index in range(self.num_layers + 1):
            self.piece(index, max_tokens)()

    @property
    def num_pieces(self) -> int:
        return self.num_layers + 1

    def piece(self, index: int, tokens: int) -> Callable[[], None]:
        """Piece `index` over the first `tokens` rows of the buffers (what a graph captures)."""
        if not 0 <= index <= self.num_layers or not 0 < tokens <= self.max_tokens:
            raise ValueError(f"no piece {index} of {tokens} tokens")
        return lambda: self._run_piece(index, tokens)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, tokens: int, replay: Replay) -> torch.Tensor:
        """The logits [B_sample, V] of `batch` (at most `tokens` tokens), its pieces run by
        `replay` at the `tokens` bucket and its attention eagerly."""
        n = batch.num_tokens
        if n > tokens:
            raise ValueError(f"{n} tokens do not fit a bucket of {tokens}")
        self.load(batch, tokens)
        step = self.model.step_context(batch)
        for layer in range(self.num_layers):
            replay(layer)
            self._attend(layer, step, n)
        replay(self.num_layers)
        hidden = self._buffers["hidden"][:n]
        residual = self._buffers["residual"][:n]
        return self.model.compute_logits(self.model.final_hidden(hidden, residual, batch))

    def load(self, batch: ForwardBatch, tokens: int) -> None:
        """Copy the step's token ids and positions in; rows n..tokens become padding."""
        n = batch.num_tokens
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.input_ids[n:tokens].zero_()
        self.positions[n:tokens].zero_()

    @torch.inference_mode()  # as the model's forward: weights whose views are rotated in place
    def _run_piece(self, index: int, tokens: int) -> None:
        step = self._static_step(tokens)
        if index == 0:
            h, residual = self.model.embed(self.input_ids[:tokens]), None
        else:
            out, residual = self._buffers["out"][:tokens], self._buffers["residual"][:tokens]
            h, residual = self.layers[index - 1].attention_output(out, residual, step)
        if index < self.num_layers:
            q, k, v, residual = self.layers[index].attention_input(h, residual, step)
            for name, value in (("q", q), ("k", k), ("v", v)):
                self._store(name, value, tokens)
            if "out" not in self._buffers:
                self._buffers["out"] = torch.zeros_like(self._buffers["q"])
        else:
            self._store("hidden", h, tokens)
        assert residual is not None
        self._store("residual", residual, tokens)

    def _attend(self, layer: int, step: StepContext, n: int) -> None:
        """Layer `layer`'s attention over the real rows: store their K/V, attend, and leave the
        output where the next piece reads it."""
        assert self.model.kv_caches is not None
        attn = self.layers[layer].self_attn
        q, k, v = (self._buffers[name][:n] for name in ("q", "k", "v"))
        kv_cache = self.model.kv_caches[layer]
        out = paged_attention(step, q, k, v, kv_cache, attn.scale, attn.window)
        self._buffers["out"][:n].copy_(out)

    def _store(self, name: str, value: torch.Tensor, tokens: int) -> None:
        """Copy `value` ([tokens, ...]) into the static buffer `name`, made on first use."""
        buffer = self._buffers.get(name)
        if buffer is None:
            shape = (self.max_tokens, *value.shape[1:])
            buffer = self._buffers[name] = value.new_zeros(shape)
        buffer[:tokens].copy_(value)

    def _static_step(self, tokens: int) -> StepContext:
        """What the pieces read of a step (the backend, the RoPE tables, the static positions):
        one request of `tokens` new tokens, with no attention plan (attention is not in them)."""
        step = self._steps.get(tokens)
        if step is None:
            device = self.input_ids.device
            one = torch.tensor([tokens], dtype=torch.int32, device=device)
            batch = ForwardBatch(
                input_ids=self.input_ids[:tokens],
                positions=self.positions[:tokens],
                slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
                block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
                query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
                context_lens=one,
                is_decode_only=False,
                logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
            )
            model = self.model
            step = StepContext(
                batch, model.attention_backend, model.cos_sin, None, model.cos_sin_local
            )
            self._steps[tokens] = step
        return step
