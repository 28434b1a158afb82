"""Echo scores, `prompt_logprobs` and `include_stop_str_in_output` through the openai SDK
against the live server on the real SmolLM2, the scores against transformers on the same GGUF.

The server keeps K and V in float16 (the CPU default), so the scores agree with float32
transformers within `ATOL`, not exactly (tests/engine/models/test_prompt_logprobs.py compares
with float32 KV: within 1e-4)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from deepinfer.environment import default_model_path
from tests.api.live_server import LiveServer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ATOL = 2e-2
"""float16 KV against float32 (measured: at most 5e-3)."""
TEXT = (
    "The Nile is the longest river in Africa. It flows north through eleven countries before "
    "it reaches the Mediterranean Sea, and its delta has been farmed for thousands of years."
)


@pytest.fixture(scope="module")
def oai(real_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor, Any]:
    """The prompt's ids, transformers' log_softmax of its logits, and its tokenizer."""
    path = default_model_path()
    kwargs = {"gguf_file": path.name}
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, **kwargs
    )
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1), tok


def test_echo_scores_match_transformers(oai: openai.OpenAI, reference: Any) -> None:
    ids, logprobs, tok = reference
    r = oai.completions.create(model="m", prompt=ids, echo=True, logprobs=3, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    want = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp.token_logprobs[1:])
    assert (got - want).abs().max().item() < ATOL
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert top is not None and 3 <= len(top) <= 4  # the 3 most likely, and the token
        best = logprobs[i].max().item()
        assert max(top.values()) == pytest.approx(best, abs=ATOL)


def test_prompt_logprobs_agree_with_echo(oai: openai.OpenAI, reference: Any) -> None:
    """vLLM's shape on completions and chat: the same scores as the echo's, ranks right."""
    ids, logprobs, _ = reference
    echo = oai.completions.create(model="m", prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert echo.choices[0].logprobs is not None
    scores = echo.choices[0].logprobs.token_logprobs
    assert scores is not None
    r = oai.completions.create(
        model="m", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    entries = (r.choices[0].model_extra or {})["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i, entry in enumerate(entries[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(scores[i], abs=1e-5)
        rank = 1 + (logprobs[i - 1] > logprobs[i - 1, ids[i]] + ATOL).sum().item()
        assert rank <= own["rank"] <= 1 + (logprobs[i - 1] > own["logprob"] - ATOL).sum().item()
        assert {e["rank"] for e in entry.values()} >= {1, 2}
    chat = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    chat_entries = (chat.model_extra or {})["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(e) == 1 for e in chat_entries[1:])


def test_include_stop_str_in_output(oai: openai.OpenAI) -> None:
    prompt = "1, 2, 3, 4, 5, 6, 7,"
    args: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": 20, "temperature": 0}
    full = oai.completions.create(**args).choices[0].text
    assert " 10" in full
    kept = oai.completions.create(
        **args, stop=[" 10"], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == full[: full.index(" 10") + 3]
    assert kept.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(
        **args, stop=[" 10"], stream=True, extra_body={"include_stop_str_in_output": True}
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.choices[0].text
