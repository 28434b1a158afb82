"""`RequestStream` with a speculative step's multi-token delta: a stop string completed inside
the run ends the stream at that token, exactly as one-token deltas would."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.stream import RequestStream
from deepinfer.engine.types import GenerationOutput
from deepinfer.environment import default_model_path
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.outputs import PromptLogprob, SampledToken, TokenDelta
from deepinfer.request import FinishReason
from deepinfer.text.detokenizer import CONTROL_MARK, IncrementalDetokenizer
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


async def test_a_kept_stop_string_ends_the_text() -> None:
    """`include_stop_str_in_output`: the text up to the stop and the stop itself, nothing after
    it, whether the stop ends inside the text or at its very end."""
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path()))
    ids = tokenizer.encode("Hello there, world. The END is near, said the sign.")
    for stop, want in (("END", "Hello there, world. The END"), ("sign.", None)):
        detok = IncrementalDetokenizer(tokenizer)
        stream = RequestStream(
            "r", 3, detok, (stop,), frozenset(), lambda _: None, include_stop=True
        )
        stream.push(_delta(ids, 0, FinishReason.LENGTH))
        out = await anext(stream)
        assert out.text == (want or tokenizer.decode(ids))
        assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, stop)


async def test_prompt_logprobs_come_once_with_the_first_output() -> None:
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path()))
    stream = _stream(tokenizer, ())
    scores = (PromptLogprob(7, -1.5, 2, ((8, -0.5),)),)
    stream.push(dataclasses.replace(_delta([5], 0), prompt_logprobs=scores))
    stream.push(_delta([6], 1, FinishReason.LENGTH))
    out = await anext(stream)
    assert out.prompt_logprobs == scores and out.token_ids == (5, 6)
    plain = _stream(tokenizer, ())
    plain.push(_delta([5], 0, FinishReason.LENGTH))
    assert (await anext(plain)).prompt_logprobs is None


async def test_without_stop_strings_a_run_is_one_delta() -> None:
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path()))
    ids = tokenizer.encode("Plain text, no stops here.")
    stream = _stream(tokenizer, ())
    assert stream.push(_delta(ids, 0, FinishReason.LENGTH)) is False
    out = await anext(stream)
    assert out.token_ids == tuple(ids) and out.text == "Plain text, no stops here."
    assert out.usage.completion_tokens == len(ids)


_TOKENIZER = Tokenizer.from_gguf(open_gguf(default_model_path()))


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(0, 49151), min_size=1, max_size=40),
    takes=st.sets(st.integers(0, 39)),
    stop_at_end=st.booleans(),
)
async def test_text_made_at_take_equals_text_made_per_push(
    ids: list[int], takes: set[int], stop_at_end: bool
) -> None:
    """A stream without stop strings detokenizes when its reader takes; one watching a stop
    string that never matches detokenizes every push. Whatever the ids (cut characters, control
    tokens) and wherever the reader takes, the texts, ids and usage agree."""
    if stop_at_end:
        ids = [*ids, 2]  # the stop token: counted, never rendered
    finish = FinishReason.STOP if stop_at_end else FinishReason.LENGTH
    streams = [_stream(_TOKENIZER, ()), _stream(_TOKENIZER, ("\x00never",))]
    outs: list[list[GenerationOutput]] = [[], []]
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        for stream, out in zip(streams, outs, strict=True):
            assert stream.push(_delta([t], i, finish if last else None), wake=False) is False
            if last or i in takes:
                out.append(await anext(stream))
    plain, watched = outs
    assert "".join(o.text for o in plain) == "".join(o.text for o in watched)
    if "\x00" not in "".join(o.text for o in plain):  # else the matcher holds a NUL back a while
        assert [o.text for o in plain] == [o.text for o in watched]
    assert "".join(o.text for o in plain) == _TOKENIZER.decode(
        ids[:-1] if stop_at_end else ids, skip_special_tokens=True
    )
    assert [o.token_ids for o in plain] == [o.token_ids for o in watched]
    assert plain[-1].usage == watched[-1].usage and plain[-1].finish_reason is finish


async def test_shown_control_tokens_reach_the_reader_as_marks() -> None:
    """A tool parser's control token (shown ids) comes out as CONTROL_MARK in place, with or
    without stop strings; its spelling typed as text stays text."""
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path()))
    shown = tokenizer.token_to_id("<|im_start|>")
    assert shown is not None
    ids = [*tokenizer.encode("Sure <|im_start|>"), shown, *tokenizer.encode(" [1]")]
    for stops in ((), ("never",)):
        detok = IncrementalDetokenizer(tokenizer, shown_ids=frozenset({shown}))
        stream = RequestStream("r", 3, detok, stops, frozenset({2}), lambda _rid: None)
        for i, t in enumerate(ids):
            stream.push(_delta([t], i, FinishReason.LENGTH if i == len(ids) - 1 else None))
        out = await anext(stream)
        assert out.text == f"Sure <|im_start|>{CONTROL_MARK} [1]", stops


async def test_prediction_tokens_in_the_usage_never_exceed_the_prediction() -> None:
    """The usage counts a prediction's accepted tokens from the engine's deltas and the rest as
    rejected; an answer that took the prediction's tokens as drafts more than once (it repeats
    itself) still reports at most the prediction's length, and nothing negative."""
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path()))
    detok = IncrementalDetokenizer(tokenizer)
    for accepted, want in ((2, (2, 3)), (9, (5, 0))):
        stream = RequestStream(
            "r", 3, detok, (), frozenset(), lambda _rid: None, num_prediction_tokens=5
        )
        delta = dataclasses.replace(_delta([40, 41], 0), num_accepted_prediction_tokens=accepted)
        stream.push(delta)
        usage = (await anext(stream)).usage
        assert (usage.accepted_prediction_tokens, usage.rejected_prediction_tokens) == want
