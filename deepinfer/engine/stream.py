"""`RequestStream`: one request's output mailbox, turning token deltas into text deltas.

A one-slot mailbox: the engine merges new output into the pending delta, so a slow reader gets
fewer, larger deltas and memory stays bounded by the request's own output. `push` wakes the
reader; the engine's delivery may instead push without waking and wake later (`wake`), so that
under heavy load a reader is woken once for several tokens (`frame_pacer.FramePacer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.engine.types import GenerationOutput, Usage
from deepinfer.outputs import PromptLogprob, SampledToken, TokenDelta
from deepinfer.request import FinishReason
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.stop import StopStringMatcher


@dataclass
class _Pending:
    text: list[str] = field(default_factory=list)
    text_ids: list[int] = field(default_factory=list)
    """Ids after `text`, detokenized when the reader takes them (no stop strings to watch)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None


class RequestStream:
    """Async iterator of `GenerationOutput` for one request; closing it early aborts the request."""

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        detokenizer: IncrementalDetokenizer,
        stops: tuple[str, ...],
        stop_token_ids: frozenset[int],
        on_abort: Callable[[str], object],
        *,
        disk_cached_tokens: int = 0,
        host_cached_tokens: int = 0,
        remote_cached_tokens: int = 0,
        include_stop: bool = False,
        num_prediction_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._detok = detokenizer
        self._matcher = StopStringMatcher(stops) if stops else None
        self._include_stop = include_stop
        """Keep a matched stop string at the end of the text."""
        self._stop_token_ids = stop_token_ids
        self._on_abort = on_abort
        self._pending = _Pending()
        self._has_pending = False
        self._waiter: asyncio.Future[None] | None = None
        """The reader's, while it waits for output."""
        self._disk_cached_tokens = disk_cached_tokens
        self._host_cached_tokens = host_cached_tokens
        self._remote_cached_tokens = remote_cached_tokens
        self._num_prediction_tokens = num_prediction_tokens
        self._accepted_prediction_tokens = 0
        self._counts = (num_prompt_tokens, 0, 0)
        """(prompt, output, cached) tokens as of the last delta; `Usage` is made per take."""
        self._finish: FinishReason | None = None
        self._stop_reason: str | int | None = None
        self._error: BaseException | None = None
        self._delivered_final = False
        self.num_unread_tokens = 0
        """Tokens merged since the reader was last woken or last took."""
        self.woken = False
        """True once the reader was woken with output (the first token is never held back)."""

    @property
    def finished(self) -> bool:
        """True once the engine delivered the final delta (the reader may not have read it)."""
        return self._finish is not None or self._error is not None

    def push(self, delta: TokenDelta, *, wake: bool = True) -> bool:
        """Merge an engine delta and, unless `wake` is False, wake the reader. Returns True when
        a stop string ended the request here (the engine must then abort it in the scheduler).
        If it raises, the stream is left unfinished for `fail` to end."""
        if self.finished:
            return False
        try:
            if self._matcher is None or len(delta.token_ids) <= 1:
                stopped = self._merge(delta)
            else:
                stopped = any(self._merge(part) for part in self._parts(delta))
        except BaseException:
            self._finish = None
            raise
        self.num_unread_tokens += len(delta.token_ids)
        if wake or self.finished:
            self.wake()
        return stopped

    def wake(self) -> None:
        """Let the reader take what was merged."""
        self.num_unread_tokens = 0
        self.woken = True
        self._notify()

    def _notify(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _parts(self, delta: TokenDelta) -> list[TokenDelta]:
        """A delta of several tokens (a speculative step's verified run) as one delta a token
        where stop strings are watched: the stream ends at the token completing a stop, and
        the tokens after it are neither output nor counted, as without speculation."""
        n = len(delta.token_ids)
        return [
            dataclasses.replace(
                delta,
                token_ids=(token_id,),
                logprobs=delta.logprobs[i : i + 1],
                prompt_logprobs=delta.prompt_logprobs if i == 0 else None,
                finish_reason=delta.finish_reason if i == n - 1 else None,
                num_output_tokens=delta.num_output_tokens - (n - 1 - i),
            )
            for i, token_id in enumerate(delta.token_ids)
        ]

    def _merge(self, delta: TokenDelta) -> bool:
        if delta.num_prompt_tokens:
            counts = delta.num_prompt_tokens, delta.num_output_tokens, delta.num_cached_tokens
            self._counts = counts
            if delta.num_accepted_prediction_tokens:
                self._accepted_prediction_tokens = delta.num_accepted_prediction_tokens
        p = self._pending
        p.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            p.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            p.prompt_logprobs = delta.prompt_logprobs
        text_ids: tuple[int, ...] = delta.token_ids
        if (
            delta.finish_reason is FinishReason.STOP
            and text_ids
            and text_ids[-1] in self._stop_token_ids
        ):
            self._stop_reason, text_ids = text_ids[-1], text_ids[:-1]
        if self._matcher is None:  # text is made once a frame, when the reader takes it
            p.text_ids.extend(text_ids)
            self._finish = delta.finish_reason
            self._has_pending = True
            return False
        text = self._detok.push(text_ids)
        matched = self._match(text)
        if matched is not None:
            self._finish, self._stop_reason = FinishReason.STOP, matched
        elif delta.finish_reason is not None:
            self._finish = delta.finish_reason
            self._flush()
        self._has_pending = True
        return matched is not None

    def _match(self, text: str) -> str | None:
        assert self._matcher is not None
        result = self._matcher.push(text)
        self._pending.text.append(result.text_to_emit)
        if result.matched is not None and self._include_stop:
            self._pending.text.append(result.matched)
        return result.matched

    def _flush(self) -> None:
        assert self._matcher is not None
        matched = self._match(self._detok.flush())
        if matched is not None:
            self._finish, self._stop_reason = FinishReason.STOP, matched
        else:
            self._pending.text.append(self._matcher.flush())

    def fail(self, error: BaseException) -> None:
        """End the stream with an error (engine shutdown or an internal failure)."""
        if not self.finished:
            self._error = error
            self._notify()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        while not self._has_pending:
            if self._error is not None:
                raise self._error
            if self._delivered_final:
                raise StopAsyncIteration
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            await waiter
        return self._take()

    def _take(self) -> GenerationOutput:
        p, self._pending, self._has_pending = self._pending, _Pending(), False
        self.num_unread_tokens = 0
        self._delivered_final = self._finish is not None
        if self._matcher is None:
            p.text.append(self._detok.push(p.text_ids))
            if self._finish is not None:
                p.text.append(self._detok.flush())
        return GenerationOutput(  # positional: one per frame, keywords cost more
            self.request_id,
            "".join(p.text),
            tuple(p.token_ids),
            tuple(p.logprobs),
            self._finish,
            self._stop_reason if self._finish is not None else None,
            self._usage(),
            p.prompt_logprobs,
        )

    def _usage(self) -> Usage:
        prompt, output, cached = self._counts
        # Tiers fill the prefix in order (device, host, disk, another replica's): a shortfall
        # (loaded blocks evicted before admission) comes off the end, the last tier's first.
        host = min(self._host_cached_tokens, cached)
        disk = min(self._disk_cached_tokens, cached - host)
        # an answer that repeats itself may take a prediction's tokens as drafts more than once
        accepted = min(self._accepted_prediction_tokens, self._num_prediction_tokens)
        return Usage(
            prompt,
            output,
            cached,
            disk_cached_tokens=disk,
            host_cached_tokens=host,
            remote_cached_tokens=min(self._remote_cached_tokens, cached - host - disk),
            accepted_prediction_tokens=accepted,
            rejected_prediction_tokens=self._num_prediction_tokens - accepted,
        )

    async def aclose(self) -> None:
        """Stop reading: an unfinished request is aborted and its KV blocks freed."""
        if not self.finished:
            self._on_abort(self.request_id)
        self._delivered_final = True
        self._has_pending = False
