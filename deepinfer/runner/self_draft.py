"""Self-speculation's drafts (`--speculative layers`), made on the worker at the start of the
step that verifies them.

The draft model is the model's own first `num_layers` layers, its final norm and its LM head,
picking greedily: no second model, no weights of its own. A decode chunk that asks for k drafts
(`ScheduledChunk.num_worker_drafts`) has slots for its last token and k more; the drafter runs k
passes over every such chunk at once, each feeding the token before (the last token, then each
draft) at its position. A pass writes its layers' KV at that position, which the verification
then writes again, all layers, in the same slots: the request's KV is the verification's, and
the drafts, like any, only decide which tokens are tried (`runner/speculative.py`).
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.kernels.greedy import greedy_ids
from deepinfer.model.forward_batch import BatchChunk, build_forward_batch
from deepinfer.model.protocol import CausalLM
from deepinfer.scheduler.output import ScheduleOutput


class SelfDrafter:
    def __init__(self, model: CausalLM, num_layers: int, block_size: int, device: torch.device):
        if not 1 <= num_layers < model.arch.num_layers:
            raise ValueError(
                f"draft_layers must be in [1, {model.arch.num_layers - 1}] for this model "
                f"({model.arch.num_layers} layers), got {num_layers}"
            )
        self.model = model
        self.num_layers = num_layers
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def fill(self, so: ScheduleOutput) -> ScheduleOutput:
        """`so` with every chunk's worker drafts made (`draft_token_ids`); `so` itself when no
        chunk asks for any."""
        wanting = [c for c in so.chunks if c.num_worker_drafts]
        if not wanting:
            return so
        drafts: dict[str, list[int]] = {c.request_id: [] for c in wanting}
        fed = {c.request_id: c.request.all_token_ids[c.start_position] for c in wanting}
        for j in range(max(c.num_worker_drafts for c in wanting)):
            active = [c for c in wanting if c.num_worker_drafts > j]
            batch = build_forward_batch(
                [
                    BatchChunk([fed[c.request_id]], c.start_position + j, c.block_ids)
                    for c in active
                ],
                self.block_size,
                self.device,
            )
            hidden = self.model.forward_hidden(batch, self.num_layers)
            picks: list[int] = greedy_ids(self.model.compute_logits(hidden)).tolist()
            for c, token_id in zip(active, picks, strict=True):
                token_id = max(token_id, 0)  # a row with no finite logit drafts token 0
                drafts[c.request_id].append(token_id)
                fed[c.request_id] = token_id
        chunks = tuple(
            dataclasses.replace(c, draft_token_ids=tuple(drafts[c.request_id]), num_worker_drafts=0)
            if c.num_worker_drafts
            else c
            for c in so.chunks
        )
        return dataclasses.replace(so, chunks=chunks)
