"""`RequestStream` with a speculative step's multi-token delta: a stop string completed inside
the run ends the stream at that token, exactly as one-token deltas would."""

from __future__ import annotations

from deepinfer.engine.stream import RequestStream
from deepinfer.environment import default_model_path
from deepinfer.model.gguf_loader import open_gguf
from deepinfer.outputs import SampledToken, TokenDelta
from deepinfer.request import FinishReason
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.tokenizer import Tokenizer


def _stream(tokenizer: Tokenizer, stops: tuple[str, ...]) -> RequestStream:
    detok = IncrementalDetokenizer(tokenizer)
    return RequestStream("r", 3, detok, stops, frozenset({2}), lambda _rid: None)


def _delta(ids: list[int], done_before: int, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta(
        "r",
        tuple(ids),
        logprobs=tuple(SampledToken(t, -0.5) for t in ids),
        finish_reason=finish,
        num_prompt_tokens=3,
        num_output_tokens=done_before + len(ids),
    )


async def test_a_stop_inside_a_run_ends_at_its_token() -> None:
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path()))
    ids = tokenizer.encode("Hello there, world. The END is near, said the sign.")
    stop = "END"
    one_by_one, whole = _stream(tokenizer, (stop,)), _stream(tokenizer, (stop,))
    for i, t in enumerate(ids):
        if one_by_one.push(_delta([t], i)):
            break
    assert whole.push(_delta(ids[:2], 0)) is False
    assert whole.push(_delta(ids[2:], 2, FinishReason.LENGTH)) is True  # the run past the stop
    want, got = await anext(one_by_one), await anext(whole)
    assert got.token_ids == want.token_ids and len(got.token_ids) < len(ids)
    assert got.text == want.text == "Hello there, world. The "
    assert got.usage == want.usage and got.usage.completion_tokens == len(want.token_ids)
    assert got.logprobs == want.logprobs and len(got.logprobs) == len(got.token_ids)
    assert (got.finish_reason, got.stop_reason) == (FinishReason.STOP, stop)


async def test_without_stop_strings_a_run_is_one_delta() -> None:
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path()))
    ids = tokenizer.encode("Plain text, no stops here.")
    stream = _stream(tokenizer, ())
    assert stream.push(_delta(ids, 0, FinishReason.LENGTH)) is False
    out = await anext(stream)
    assert out.token_ids == tuple(ids) and out.text == "Plain text, no stops here."
    assert out.usage.completion_tokens == len(ids)
