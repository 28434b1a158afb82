"""A tiny random DeepSeek-V3 checkpoint with a multi-token-prediction layer, as DeepSeek ships
one (`num_nextn_predict_layers: 1`, the layer's tensors at the index after the decoder's), and
the MTP layer's reference composition built from transformers' own modules.

transformers has no MTP module for DeepSeek-V3 (it drops the layer on load), so the reference
composes DeepSeek-V3's published definition (the paper's section 2.2, the layout vLLM and SGLang
load) from transformers' pieces: `eh_proj([enorm(embed(x_{i+1})); hnorm(h_i)])` through a
`DeepseekV3DecoderLayer` at the layer's index (latent attention, experts), then the shared
head's norm and projection. The layer's decoder weights are those of a 4-layer transformers
model's last layer; the 3-layer model is its first three."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.model.test_moe import COMMON, randomize


@dataclasses.dataclass
class MTPReference:
    main: Any
    """transformers' 3-layer DeepSeek-V3 (the model)."""
    full: Any
    """The 4-layer one whose last layer is the MTP layer's decoder."""
    enorm: Any
    hnorm: Any
    norm: Any
    eh_proj: torch.nn.Linear

    @torch.no_grad()
    def hidden(self, tokens: list[int]) -> torch.Tensor:  # [T, hidden]
        """The model's final (normed) hidden states."""
        return self.main.model(torch.tensor([tokens])).last_hidden_state[0].float()

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:  # [T - 1, V]
        """The MTP layer's logits at positions 0..T-2 (row i: of token i + 2)."""
        t = len(tokens) - 1
        ids = torch.tensor([tokens[1:]])
        h = self.hidden(tokens)[:-1].unsqueeze(0)
        x = self.eh_proj(
            torch.cat([self.enorm(self.main.model.embed_tokens(ids)), self.hnorm(h)], dim=-1)
        )
        positions = torch.arange(t).unsqueeze(0)
        cos_sin = self.full.model.rotary_emb(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.full.model.layers[3](
            x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
        )
        return self.main.lm_head(self.norm(out))[0].float()


def write_mtp_checkpoint(
    directory: Path, scratch: Path, vocab_size: int = 97, seed: int = 0
) -> MTPReference:
    """Write the checkpoint to `directory` (`scratch`: a directory for the 4-layer save)."""
    transformers = __import__("transformers")
    common = {**COMMON, "num_key_value_heads": 4, "vocab_size": vocab_size}
    fields = dict(
        intermediate_size=80, moe_intermediate_size=24, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    full_config = transformers.DeepseekV3Config(**{**common, "num_hidden_layers": 4}, **fields)
    full = transformers.AutoModelForCausalLM.from_config(full_config).eval()
    randomize(full)
    full.save_pretrained(scratch, safe_serialization=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(scratch.glob("*.safetensors")):
        tensors |= load_file(str(file))
    last = "model.layers.3."
    main = {k: v for k, v in tensors.items() if not k.startswith(last)}
    mtp = {k: v for k, v in tensors.items() if k.startswith(last)}
    d = full_config.hidden_size
    g = torch.Generator().manual_seed(seed + 1)
    mtp |= {
        last + "enorm.weight": 1.0 + 0.5 * torch.randn(d, generator=g),
        last + "hnorm.weight": 1.0 + 0.5 * torch.randn(d, generator=g),
        last + "eh_proj.weight": 0.2 * torch.randn(d, 2 * d, generator=g),
        last + "shared_head.norm.weight": 1.0 + 0.5 * torch.randn(d, generator=g),
        last + "embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
        last + "shared_head.head.weight": main["lm_head.weight"].clone(),
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(main, str(directory / "model.safetensors"))
    save_file(mtp, str(directory / "mtp.safetensors"))
    config = json.loads((scratch / "config.json").read_text())
    config |= {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:3]
    (directory / "config.json").write_text(json.dumps(config))

    main_model = transformers.AutoModelForCausalLM.from_config(
        transformers.DeepseekV3Config(**{**common, "num_hidden_layers": 3}, **fields)
    ).eval()
    state = {k: v for k, v in full.state_dict().items() if not k.startswith(last)}
    main_model.load_state_dict(state, strict=True)
    rms = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm
    norms = []
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norm = rms(d, eps=full_config.rms_norm_eps)
        norm.weight.data.copy_(mtp[f"{last}{name}.weight"])
        norms.append(norm)
    eh_proj = torch.nn.Linear(2 * d, d, bias=False)
    eh_proj.weight.data.copy_(mtp[last + "eh_proj.weight"])
    return MTPReference(main_model, full, norms[0], norms[1], norms[2], eh_proj)
