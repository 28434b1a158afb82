"""Session fixtures for text tests: the real SmolLM2 GGUF header, parsed once a process by the
loader that every engine on it shares."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer.environment import default_model_path
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def gguf_reader() -> Any:
    return open_gguf(default_model_path())


@pytest.fixture(scope="session")
def smollm_tokenizer(gguf_reader: Any) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_reader)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(gguf_reader: Any) -> Any:
    """The reference: transformers' GGUF tokenizer conversion (the code path of
    `AutoTokenizer.from_pretrained(dir, gguf_file=...)`), fed this file's metadata. Calling it
    directly skips transformers re-parsing the whole file (20+ s on a busy 2-core machine)."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    def field(key: str) -> Any:
        return gguf_reader.fields[f"tokenizer.ggml.{key}"].contents()

    metadata = {
        "tokenizer_type": field("model"),
        "pre_tokenizer_type": field("pre"),
        "tokens": field("tokens"),
        "merges": field("merges"),
        "token_type": field("token_type"),
    }
    backend, _ = convert_gguf_tokenizer("llama", metadata)
    return backend
