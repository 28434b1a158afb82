"""Multi-token prediction (DeepSeek-V3's `num_nextn_predict_layers`): a layer trained beside the
model to predict the token after next, kept in the checkpoint after the decoder's layers, here
a draft proposer (`--speculative mtp`, `runner/worker_mtp.py`).

At position i it combines the model's final (normed) hidden state h_i with the embedding of the
next token x_{i+1}: `eh_proj([enorm(embed(x_{i+1})); hnorm(h_i)])`, through one decoder layer of
the model's kind (latent attention and experts for DeepSeek-V3, attending to its own KV of the
positions before), then its own norm and head: the logits of x_{i+2}. Drafts after the first
chain on the layer's own output in place of h (the layer's output before its norm, as vLLM and
SGLang chain DeepSeek's MTP). Its KV is one layer's, in caches of its own indexed by the same
block ids as the model's (`engine/build_replicas.py`).

The checkpoint stores the layer's embedding table and head (copies of the model's in DeepSeek's
releases); they are loaded as stored. A checkpoint with several MTP layers drafts with the
first."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from deepinfer.errors import ModelLoadError
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.kv_layout import KVCaches, check_kv_caches
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.llama_layers import Embedding, Linear, RMSNorm, cpu_aware_linear
from deepinfer.model.loading.safetensors_loader import open_safetensors_dir
from deepinfer.model.loading.weights import mtp_state_dict
from deepinfer.model.step_context import step_context


class MTPHead(nn.Module):
    """The model's first multi-token-prediction layer: `forward_hidden(batch, previous)` gives
    every row's output (`previous`: each row's h), `compute_logits` the logits of the rows
    given."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        arch = model.arch
        self.arch = dataclasses.replace(arch, num_layers=1)
        """The model's architecture as one layer's (the layer itself is built at its index)."""
        self._target = (model,)  # not a submodule: its weights are not this module's
        d = arch.hidden_size
        with torch.device("meta"):
            self.enorm = RMSNorm(d)
            self.hnorm = RMSNorm(d)
            self.eh_proj = Linear(2 * d, d, bias=False)
            self.block = model.decoder_layer(arch, arch.num_layers)
            self.norm = RMSNorm(d)
            self.embed_tokens = Embedding(arch.vocab_size, d)
            self.head = Linear(d, arch.vocab_size, bias=False)
        self.kv_caches: KVCaches | None = None

    @property
    def model(self) -> LlamaForCausalLM:
        return self._target[0]

    def bind_kv_caches(self, kv_caches: KVCaches) -> None:
        """Attach the layer's (k_cache, v_cache) (one pair)."""
        check_kv_caches(self.arch, kv_caches)
        self.kv_caches = kv_caches

    @torch.inference_mode()
    def forward_hidden(
        self, batch: ForwardBatch, previous: torch.Tensor
    ) -> torch.Tensor:  # [T], [T, hidden] -> [T, hidden]
        """Every row's output: row r takes the token `batch.input_ids[r]` (x_{i+1}) at its
        position (i) and `previous[r]` (h_i); the layer's KV is written at the rows' slots."""
        if self.kv_caches is None:
            raise RuntimeError("call bind_kv_caches() before running the MTP layer")
        model, eps = self.model, self.arch.rms_norm_eps
        ops = model.attention_backend
        step = step_context(
            batch, ops, self.arch, self.kv_caches, model.cos_sin, model.cos_sin_local
        )
        embedded = ops.rms_norm(self.embed_tokens(batch.input_ids), self.enorm.weight, eps)
        hidden = ops.rms_norm(previous.to(embedded.dtype), self.hnorm.weight, eps)
        h = self.eh_proj(torch.cat([embedded, hidden], dim=-1))
        out, residual = self.block(h, None, self.kv_caches[0], step)
        return out + residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, V]
        normed = self.model.attention_backend.rms_norm(
            hidden.contiguous(), self.norm.weight, self.arch.rms_norm_eps
        )
        return cpu_aware_linear(normed, self.head.weight).float()


def load_mtp_head(model: LlamaForCausalLM, path: Path) -> MTPHead:
    """`model`'s first MTP layer from its Hugging Face directory `path`, in the model's dtype
    and on its device. Blocking (reads weights)."""
    if not path.is_dir() or not model.arch.num_mtp_layers:
        raise ModelLoadError(
            f"{path} has no multi-token-prediction layers (DeepSeek-V3's "
            "num_nextn_predict_layers in a model directory)"
        )
    arch, source = open_safetensors_dir(path)
    weight = model.norm.weight
    head = MTPHead(model)
    state = mtp_state_dict(arch, source, weight.dtype, weight.device)
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{path}: the MTP layer's tensors do not fit: {exc}") from exc
    return head.eval()
