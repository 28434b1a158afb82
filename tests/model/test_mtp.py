"""DeepSeek-V3's multi-token-prediction layer (`model/mtp.py`) on a tiny random checkpoint:
its logits within 1e-4 of the reference composed from transformers' modules
(`mtp_checkpoint.py`), in one pass and in chunks over its own paged KV; the model beside it
still transformers' own; checkpoints without the layer, or with tensors it does not use,
refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.errors import ModelLoadError
from deepinfer.model import load_model
from deepinfer.model.forward_batch import BatchChunk, build_forward_batch
from deepinfer.model.kv_layout import allocate_kv_caches
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.mtp import MTPHead, load_mtp_head
from tests.model.model_test_utils import SequentialBlocks, bind_fresh_caches

pytest.importorskip("transformers")

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from tests.model.mtp_checkpoint import write_mtp_checkpoint

    directory = tmp_path_factory.mktemp("deepseek-mtp")
    reference = write_mtp_checkpoint(directory, tmp_path_factory.mktemp("deepseek-4"))
    return directory, reference


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def _llama(directory: Path) -> LlamaForCausalLM:
    model = load_model(directory, torch.float32, "cpu").model
    assert isinstance(model, LlamaForCausalLM)
    return model


def _loaded(directory: Path) -> tuple[Any, MTPHead]:
    model = _llama(directory)
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    head = load_mtp_head(model, directory)
    head.bind_kv_caches(allocate_kv_caches(head.arch, 64, BLOCK_SIZE, torch.float32, "cpu"))
    return model, head


def _hidden(model: Any, blocks: SequentialBlocks, tokens: list[int]) -> torch.Tensor:
    """The model's final hidden state of every position (one prefill)."""
    chunk = BatchChunk(tokens, 0, blocks.table(0, len(tokens)))
    batch = build_forward_batch([chunk], BLOCK_SIZE)
    every = dataclasses.replace(batch, logits_indices=torch.arange(len(tokens)))
    hidden: torch.Tensor = model.forward_hidden(every)
    return hidden


@pytest.mark.parametrize("pieces", [(40,), (9, 1, 17, 13)])
def test_mtp_logits_match_the_transformers_composition(
    checkpoint: tuple[Path, Any], pieces: tuple[int, ...]
) -> None:
    """Entries 0..39 of a 41-token sequence, in one pass or in chunks (each attending to the
    layer's KV of the chunks before)."""
    directory, reference = checkpoint
    model, head = _loaded(directory)
    tokens = _prompt(41)
    blocks = SequentialBlocks(BLOCK_SIZE)
    hidden = _hidden(model, blocks, tokens)
    torch.testing.assert_close(hidden, reference.hidden(tokens), atol=1e-4, rtol=0)
    rows, start = [], 0
    for n in pieces:
        chunk = BatchChunk(tokens[start + 1 : start + n + 1], start, blocks.table(0, len(tokens)))
        batch = build_forward_batch([chunk], BLOCK_SIZE)
        out = head.forward_hidden(batch, hidden[start : start + n])
        rows.append(head.compute_logits(out))
        start += n
    torch.testing.assert_close(torch.cat(rows), reference.logits(tokens), atol=1e-4, rtol=0)


def test_the_model_beside_the_layer_is_transformers(checkpoint: tuple[Path, Any]) -> None:
    directory, reference = checkpoint
    loaded = load_model(directory, torch.float32, "cpu")
    assert loaded.arch.num_mtp_layers == 1 and loaded.arch.num_layers == 3
    model = loaded.model
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    tokens = _prompt(23, seed=2)
    chunk = BatchChunk(tokens, 0, SequentialBlocks(BLOCK_SIZE).table(0, len(tokens)))
    batch = build_forward_batch([chunk], BLOCK_SIZE)
    every = dataclasses.replace(batch, logits_indices=torch.arange(len(tokens)))
    with torch.no_grad():
        want = reference.main(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(model(every), want, atol=1e-4, rtol=0)


def test_a_model_without_the_layer_is_refused(tiny_llama_dir: Path) -> None:
    model = _llama(tiny_llama_dir)
    with pytest.raises(ModelLoadError, match="no multi-token-prediction layers"):
        load_mtp_head(model, tiny_llama_dir)


def _copy(directory: Path, tmp_path: Path, *names: str) -> Path:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in names:
        (copy / name).write_bytes((directory / name).read_bytes())
    return copy


def test_an_unknown_tensor_of_the_layer_is_refused(
    checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    directory, _ = checkpoint
    copy = _copy(directory, tmp_path, "model.safetensors", "config.json")
    mtp = load_file(str(directory / "mtp.safetensors"))
    mtp["model.layers.3.mystery.weight"] = torch.zeros(4)
    save_file(mtp, str(copy / "mtp.safetensors"))
    model = _llama(copy)
    with pytest.raises(ModelLoadError, match=r"does not use: layers\.3\.mystery\.weight"):
        load_mtp_head(model, copy)


def test_layer_tensors_without_the_config_field_are_refused(
    checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    """Without `num_nextn_predict_layers` the layer's tensors are unknown ones, as before."""
    directory, _ = checkpoint
    copy = _copy(directory, tmp_path, "model.safetensors", "mtp.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="does not use"):
        load_model(copy, torch.float32, "cpu")
