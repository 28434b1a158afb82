"""A model with Llama 3's chat template, end to end: the engine encodes chat messages in its
format and ends an answer on `<|eot_id|>` (the tiny random Llama, its vocabulary extended by
Llama 3's control tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.config import WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import FinishReason, SamplingParams
from deepinfer.text.messages import ChatMessage
from deepinfer.text.recipe_families import Llama3Recipe
from tests.engine.tiny_engine import tiny_config

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CONTROLS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)


@pytest.fixture(scope="module")
def llama3_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama3")
    hf = HFTokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    base = hf.get_vocab_size(with_added_tokens=True)
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in CONTROLS])
    hf.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "add_bos_token": False,
        "chat_template": LLAMA3_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    embed = tensors["embed_tokens.weight"]
    extra = torch.randn(len(CONTROLS), embed.shape[1], generator=torch.Generator().manual_seed(1))
    tensors["embed_tokens.weight"] = torch.cat([embed, 0.1 * extra])
    save_file(tensors, str(path / "model.safetensors"))
    model = json.loads((tiny_llama_dir / "config.json").read_text())
    model["vocab_size"] = base + len(CONTROLS)
    (path / "config.json").write_text(json.dumps(model))
    return path


async def test_llama3_format_end_to_end(llama3_dir: Path) -> None:
    config = tiny_config(llama3_dir, WorkersConfig())
    async with AsyncEngine(config) as engine:
        recipe = engine.recipe
        assert isinstance(recipe, Llama3Recipe)
        tok = recipe.tokenizer
        eot = tok.token_to_id("<|eot_id|>")
        assert eot is not None and eot in recipe.end_of_turn_ids
        messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi <|eot_id|>")]
        ids = recipe.encode(messages)
        assert tok.decode(ids) == (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi <|eot_id|><|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        assert ids.count(eot) == 2  # the typed one stayed text
        # An answer made to end at once (its end-of-turn token pushed up): a stop on that
        # token; without the push, plain tokens up to max_tokens.
        ending = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((eot, 100.0),))
        deltas = [d async for d in engine.generate(messages, ending)]
        assert deltas[-1].finish_reason == FinishReason.STOP
        assert [t for d in deltas for t in d.token_ids] == [eot]
        free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = [t for d in [d async for d in engine.generate(messages, free)] for t in d.token_ids]
        assert len(out) == 8
