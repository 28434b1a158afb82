"""A small engine implementing the `AsyncEngine` contract, for fast API tests.

Character-level tokenizer (control tokens 0-2 never produced by `encode`), a ChatML-like recipe,
a reply of fixed text (or `reply`, set by a test: e.g. a scripted tool call) generated one token
per step, a block pool whose use is checked, and a
prefix cache of whole blocks.

Given a real chat `recipe`, the fake encodes prompts with it and replies in its tokenizer's ids
(`reply_ids` scripts them, a family's control tokens included), detokenized as the engine does
(the request's shown control tokens as marks).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance as llg

from deepinfer.engine.types import EngineStats, GenerationOutput, Usage
from deepinfer.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
)
from deepinfer.kv_transfer.params import KVTransferParams
from deepinfer.outputs import PromptLogprob, SampledToken
from deepinfer.request import FinishReason, SamplingParams
from deepinfer.sampling.grammar import grammar_text
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.reasoning import ReasoningFormat
from deepinfer.text.recipe import ChatMessage, ChatRecipe, ToolSpec

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_OPEN_ID, THINK_CLOSE_ID = 0x110000 + 3, 0x110000 + 4
THINK = {THINK_OPEN_ID: "<think>", THINK_CLOSE_ID: "</think>"}
"""Think markers past the characters, for a recipe given a `ReasoningFormat` (`reasoning`):
a scripted reply spells them `\x00<think>` / `\x00</think>` (`reply_ids`)."""
REPLY = "Hello there! I am a fake model, replying one character per step. "


class FakeTokenizer:
    vocab_size = len(SPECIALS) + 0x110000 + len(THINK)
    max_token_bytes: int | None = None
    """No untokenized refusals: API tests send prompts of any size through."""

    def encode(self, text: str) -> list[int]:
        return [len(SPECIALS) + ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(
            ("" if skip_special_tokens else SPECIALS[i]) if i < len(SPECIALS) else self.text(i)
            for i in ids
        )

    @staticmethod
    def text(token_id: int) -> str:
        return THINK.get(token_id) or chr(token_id - len(SPECIALS))


class FakeRecipe:
    turn_stops: tuple[str, ...] = ()

    def __init__(self, tokenizer: FakeTokenizer) -> None:
        self.tok = tokenizer
        self.reasoning: ReasoningFormat | None = None
        """Set by a test: answers are split by the think-marker ids (`THINK`)."""

    def encode(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        reasoning_effort: Any = None,
        tools: Sequence[ToolSpec] = (),
        continue_final_message: bool = False,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        ids: list[int] = []
        if tools:
            defs = "\n".join(t.definition for t in tools)
            ids += [1, *self.tok.encode(f"tools\n{defs}"), 2, *self.tok.encode("\n")]
        for i, m in enumerate(messages):
            if m.role not in ("system", "user", "assistant", "tool"):
                raise InvalidRequestError(
                    f"messages[{i}].role is {m.role!r}", f"messages[{i}].role"
                )
            calls = "".join(f"\n{c.name}({c.arguments})" for c in m.tool_calls)
            body = f"{m.role}\n{m.content}{calls}"
            ids += [1, *self.tok.encode(body), 2, *self.tok.encode("\n")]
        if continue_final_message:  # the final turn left open (a prefill)
            if not messages or messages[-1].role != "assistant":
                raise InvalidRequestError("no assistant message to continue", "messages")
            del ids[-2:]
        elif add_generation_prompt:
            ids += [1, *self.tok.encode("assistant\n")]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        return self.tok.encode(text)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    reply: list[int]
    stop_reason: str | None
    stream: FakeStream
    detok: IncrementalDetokenizer | None = None
    cached: int = 0
    num_output: int = 0
    blocks: int = 0


@dataclass
class FakeStream:
    request_id: str
    num_prompt_tokens: int
    engine: FakeEngine
    pending: list[GenerationOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False
    error: BaseException | None = None

    def push(self, out: GenerationOutput) -> None:
        """One-slot mailbox: merge with an unread delta."""
        if self.pending:
            prev = self.pending.pop()
            out = GenerationOutput(
                out.request_id, prev.text + out.text, prev.token_ids + out.token_ids,
                prev.logprobs + out.logprobs, out.finish_reason, out.stop_reason, out.usage,
                prev.prompt_logprobs or out.prompt_logprobs,
            )  # fmt: skip
            self.engine.num_merges += 1
        self.pending.append(out)
        self.event.set()

    def __aiter__(self) -> AsyncIterator[GenerationOutput]:
        return self

    async def __anext__(self) -> GenerationOutput:
        while not self.pending:
            if self.error is not None:
                raise self.error
            if self.done:
                raise StopAsyncIteration
            self.event.clear()
            await self.event.wait()
        out = self.pending.pop()
        if out.finished:
            self.done = True
        return out

    async def aclose(self) -> None:
        self.engine.abort(self.request_id)
        self.done = True
        self.pending.clear()


class FakeEngine:
    def __init__(
        self, *, max_model_len: int = 2048, num_blocks: int = 4096, block_size: int = 4,
        max_active: int = 256, max_waiting: int = 1024, step_s: float = 0.002,
        recipe: ChatRecipe | None = None,
    ) -> None:  # fmt: skip
        self.tokenizer: Any = FakeTokenizer() if recipe is None else recipe.tokenizer
        self.recipe: Any = FakeRecipe(self.tokenizer) if recipe is None else recipe
        self.real_recipe = recipe is not None
        self.model_name = "fake-model"
        self.system_fingerprint = "fp_0123456789ab-default"
        self.max_model_len = max_model_len
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_active, self.step_s = max_active, step_s
        self.max_waiting = max_waiting
        """The most requests it ever queues: more at once than this are always refused."""
        self.step_observers: list[Any] = []
        self.num_merges = 0
        self.num_aborted = 0
        self.reply = REPLY
        self.reply_ids: list[int] | None = None
        """Scripted reply ids (with a real recipe), used instead of `reply` when set."""
        self.last_prompt: list[int] = []
        self.last_params: SamplingParams | None = None
        """The sampling parameters of the latest request submitted."""
        self.last_cache_retention: str | None = None
        """The retention class of the latest request submitted."""
        self.last_prediction: str | None = None
        self.last_kv_transfer: KVTransferParams | None = None
        """The prediction text of the latest request submitted."""
        self._reqs: dict[str, _Req] = {}
        self._seen_prefixes: set[tuple[int, ...]] = set()
        self._used_blocks = 0
        self._task: asyncio.Task[None] | None = None
        self._counter = 0

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def dead_reason(self) -> str | None:
        return None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        for r in list(self._reqs.values()):
            r.stream.error = EngineDeadError("shutting down")
            r.stream.event.set()
            self._release(r)

    async def __aenter__(self) -> FakeEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def stats(self) -> EngineStats:
        return EngineStats(
            0, len(self._reqs), self.num_blocks, self._used_blocks, self.max_model_len
        )

    def kv_transfer_params(self, request_id: str) -> KVTransferParams | None:
        return None

    def check_integrity(self) -> None:
        assert self._used_blocks == sum(r.blocks for r in self._reqs.values())
        assert 0 <= self._used_blocks <= self.num_blocks

    async def submit(
        self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
        reasoning_effort: Any = None, cache_salt: str | None = None,
        cache_retention: str | None = None, prediction: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> FakeStream:  # fmt: skip
        if not self.is_running:
            raise EngineDeadError("not running")
        ids = list(prompt)
        if not ids or len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(len(ids), params.max_tokens, self.max_model_len)
        if len(self._reqs) >= min(self.max_active, self.max_waiting):
            raise OverloadedError("too many requests", retry_after_s=2)
        _check_parts(params)
        self._counter += 1
        self.last_params, self.last_prompt = params, ids
        self.last_cache_retention = cache_retention
        self.last_prediction = prediction
        self.last_kv_transfer = kv_transfer
        rid = request_id or f"fake-{self._counter}"
        reply, stop_reason = self.reply, None
        for s in params.stop:
            if s in reply:
                end = reply.index(s) + (len(s) if params.include_stop_str_in_output else 0)
                reply, stop_reason = reply[:end], s
        stream = FakeStream(rid, len(ids), self)
        scripted = reply_ids(self.tokenizer, reply) if self.reply_ids is None else self.reply_ids
        detok = None
        if self.real_recipe:
            detok = IncrementalDetokenizer(
                self.tokenizer, shown_ids=frozenset(params.shown_token_ids)
            )
        self._reqs[rid] = _Req(rid, ids, params, scripted, stop_reason, stream, detok)
        return stream

    def abort(self, request_id: str) -> bool:
        r = self._reqs.get(request_id)
        if r is None:
            return False
        self.num_aborted += 1
        self._release(r)
        return True

    def _release(self, r: _Req) -> None:
        self._used_blocks -= r.blocks
        r.blocks = 0
        del self._reqs[r.rid]

    def _cached_tokens(self, prompt: list[int]) -> int:
        bs = self.block_size
        k = (len(prompt) - 1) // bs
        while k > 0 and tuple(prompt[: k * bs]) not in self._seen_prefixes:
            k -= 1
        return k * bs

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for r in list(self._reqs.values()):
                self._step(r)
            for obs in self.step_observers:
                obs(None, type("Out", (), {"elapsed_s": self.step_s})())

    def _step(self, r: _Req) -> None:
        """One token: the reply's next character, then end-of-turn (id 0, no text) or the stop
        string (not emitted); `ignore_eos` cycles the reply until max_tokens."""
        if r.num_output == 0 and r.blocks == 0:
            r.cached = self._cached_tokens(r.prompt)
        p, n = r.params, r.num_output
        finish: FinishReason | None = None
        if p.ignore_eos:
            token = r.reply[n % len(r.reply)] if r.reply else 3
        elif n < len(r.reply):
            token = r.reply[n]
        else:
            token, finish = 0, FinishReason.STOP
        if finish is None and n + 1 >= p.max_tokens:
            finish = FinishReason.LENGTH
        r.num_output += 1
        need = math.ceil((len(r.prompt) + r.num_output) / self.block_size)
        self._used_blocks += need - r.blocks
        r.blocks = need
        lp: tuple[SampledToken, ...] = ()
        if p.logprobs is not None:
            lp = (
                SampledToken(token, -0.5, tuple((token + k, -0.5 - k) for k in range(p.logprobs))),
            )
        if r.detok is not None:
            text = r.detok.push([] if token == 0 else [token])
            text += r.detok.flush() if finish is not None else ""
        else:
            text = "" if token == 0 else self.tokenizer.decode([token])
        stop_reason = r.stop_reason if finish is FinishReason.STOP else None
        usage = Usage(len(r.prompt), r.num_output, r.cached)
        scores = _prompt_scores(r.prompt, p.prompt_logprobs) if n == 0 else None
        out = GenerationOutput(r.rid, text, (token,), lp, finish, stop_reason, usage, scores)
        r.stream.push(out)
        if finish is not None:
            bs = self.block_size
            for k in range(1, len(r.prompt) // bs + 1):
                self._seen_prefixes.add(tuple(r.prompt[: k * bs]))
            self._release(r)


def _prompt_scores(prompt: list[int], num_top: int | None) -> tuple[PromptLogprob, ...] | None:
    """Made-up prompt logprobs: token i + 1 scores -0.25 * (i + 1), the most likely of its
    position, followed by the ids after it, each 1 less likely."""
    if num_top is None:
        return None
    entries = []
    for i, token in enumerate(prompt[1:]):
        lp = -0.25 * (i + 1)
        top = tuple((token + k, lp - k) for k in range(num_top))
        entries.append(PromptLogprob(token, lp, 1, top))
    return tuple(entries)


def reply_ids(tok: FakeTokenizer, reply: str) -> list[int]:
    """A scripted reply's ids: `\x00<think>` and `\x00</think>` are the marker ids."""
    ids: list[int] = []
    for k, part in enumerate(reply.split("\x00")):
        marker = next((i for i, t in THINK.items() if k and part.startswith(t)), None)
        if marker is not None:
            ids.append(marker)
            part = part[len(THINK[marker]) :]
        ids += tok.encode(part)
    return ids


def _check_parts(params: SamplingParams) -> None:
    """The real engine probes each part of a grammar (a tool's schema, a response format) in a
    child process; the fake checks them in process (its tests' schemas are small)."""
    spec = params.structured
    for part in spec.parts if spec is not None else ():
        grammar = grammar_text(part.kind, part.source)
        error = llg.LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidRequestError(
                f"{part.param}: the schema cannot be compiled: {error}", part.param
            )
