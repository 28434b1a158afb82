"""The prompt's logprobs on the wire: a completion's `echo` (OpenAI's legacy shape, prompt
tokens first) and vLLM's `prompt_logprobs` (completions and chat completions).

The engine scores the prompt tokens after the first (`SamplingParams.prompt_logprobs`); the
first has nothing before it, so both shapes give it `null`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from deepinfer.api.openai.convert import completion_logprobs, finite_logprob
from deepinfer.api.openai.schemas import CompletionLogprobs, PromptLogprobsOut, PromptTokenLogprob
from deepinfer.api.protocol import TokenizerLike
from deepinfer.outputs import PromptLogprob, SampledToken


@dataclass(frozen=True)
class PromptView:
    """What a completion choice shows of its prompt: the prompt itself before the generated
    text (`echo`), with its tokens' logprobs (`num_top`: the request's `logprobs`), vLLM's
    `prompt_logprobs` (`num_prompt_top`), and no generated output at all (`max_tokens: 0`)."""

    text: str
    ids: Sequence[int]
    echo: bool = False
    num_top: int | None = None
    num_prompt_top: int | None = None
    drop_output: bool = False


class ChoiceText:
    """One completion choice's text and legacy logprobs as its outputs arrive (all at once for
    a whole answer): the prompt's part first, with the first output."""

    def __init__(self, tokenizer: TokenizerLike, view: PromptView, want_logprobs: bool) -> None:
        self._tok = tokenizer
        self._view = view
        self._want_logprobs = want_logprobs
        self._offset = 0
        """Characters of the choice's text so far (the legacy `text_offset`)."""
        self._started = False

    def next(
        self,
        text: str,
        logprobs: Sequence[SampledToken],
        prompt_entries: Sequence[PromptLogprob] | None,
    ) -> tuple[str, CompletionLogprobs | None, PromptLogprobsOut | msgspec.UnsetType]:
        """(text, logprobs, prompt_logprobs) of the choice's next piece."""
        view, tok = self._view, self._tok
        if view.drop_output:
            text, logprobs = "", ()
        head, head_lp = "", None
        scores: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET
        if not self._started:
            self._started = True
            entries = prompt_entries or ()
            if view.echo:
                head = view.text
                if view.num_top is not None:
                    head_lp = echo_logprobs(tok, view.ids, entries, view.num_top)
            if view.num_prompt_top is not None:
                scores = vllm_prompt_logprobs(tok, entries, view.num_prompt_top)
        start = self._offset + len(head)
        lp = completion_logprobs(tok, logprobs, start) if self._want_logprobs else None
        if head_lp is not None:
            lp = join_logprobs(head_lp, lp)
        self._offset = start + len(text)
        return head + text, lp, scores


def echo_logprobs(
    tokenizer: TokenizerLike,
    prompt_ids: Sequence[int],
    entries: Sequence[PromptLogprob],
    num_top: int,
) -> CompletionLogprobs:
    """The prompt's tokens in the legacy shape: each token's logprob and its `num_top` most
    likely alternatives, with the token itself among them (as OpenAI lists the sampled one)."""
    assert len(entries) == len(prompt_ids) - 1, "one entry per prompt token after the first"
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    assert out.top_logprobs is not None
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        text = tokenizer.decode([token_id])
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if i == 0:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        e = entries[i - 1]
        logprob = finite_logprob(e.logprob)
        top = {tokenizer.decode([t]): finite_logprob(lp) for t, lp in e.top_logprobs[:num_top]}
        top.setdefault(text, logprob)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
    return out


def join_logprobs(head: CompletionLogprobs, tail: CompletionLogprobs | None) -> CompletionLogprobs:
    """`head` (the echoed prompt's) followed by `tail` (the generated tokens')."""
    if tail is None:
        return head
    assert head.top_logprobs is not None and tail.top_logprobs is not None
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )


def vllm_prompt_logprobs(
    tokenizer: TokenizerLike, entries: Sequence[PromptLogprob], num_top: int
) -> PromptLogprobsOut:
    """vLLM's shape: per prompt token (the first `null`), itself and its `num_top` most likely
    tokens, by token id, each with its logprob, rank and text."""
    out: PromptLogprobsOut = [None]
    for e in entries:
        own = PromptTokenLogprob(finite_logprob(e.logprob), e.rank, tokenizer.decode([e.token_id]))
        tokens = {str(e.token_id): own}
        for rank, (t, lp) in enumerate(e.top_logprobs[:num_top], start=1):
            top = PromptTokenLogprob(finite_logprob(lp), rank, tokenizer.decode([t]))
            tokens.setdefault(str(t), top)
        out.append(tokens)
    return out
