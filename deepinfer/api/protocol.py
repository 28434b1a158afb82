"""What the API needs from an engine: the `AsyncEngine` contract, as structural types.

The API codes against these protocols so that tests can serve a small fake engine, and so that
nothing here imports the engine package at module load (imports point down: api -> engine).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from deepinfer.engine.types import EngineStats, GenerationOutput
from deepinfer.kv_transfer.params import KVTransferParams
from deepinfer.request import SamplingParams

if TYPE_CHECKING:
    from deepinfer.text.recipe import ChatMessage, ToolSpec


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token markers typed in the text are plain text."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; with `skip_special_tokens`, as the engine's answers are (control
        tokens dropped)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_token_bytes(self) -> int | None:
        """UTF-8 bytes of the longest token, bounding a text's token count from below; None
        when the tokenizer cannot promise one (a prompt is then never refused untokenized)."""
        ...


class RecipeLike(Protocol):
    @property
    def turn_stops(self) -> tuple[str, ...]:
        """Text that begins another turn where no token ends one: chat answers stop there."""
        ...

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
        """Prompt ids for chat messages and the tools they may call (injection-safe), the final
        assistant message left open with `continue_final_message`; raises InvalidRequestError."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Ids for a raw completion prompt (BOS when the model wants it; specials stay text)."""
        ...


class OutputStream(Protocol):
    """One request's outputs (deltas, merged for slow readers); the last one has a finish reason."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    def __aiter__(self) -> AsyncIterator[GenerationOutput]: ...

    async def aclose(self) -> None:
        """Abort the request if unfinished (frees its KV blocks); idempotent."""
        ...


class EngineClient(Protocol):
    @property
    def is_running(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving after an unrecoverable error (None otherwise)."""
        ...

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def recipe(self) -> RecipeLike: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_waiting(self) -> int:
        """The most requests ever queued at once: a batch of more is refused whole (400), while
        one that fits but finds the queue full now is `OverloadedError` (429)."""
        ...

    @property
    def system_fingerprint(self) -> str:
        """The model fingerprint and the arithmetic mode (`--batch-invariant` or not)."""
        ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        reasoning_effort: Any = None,
        cache_salt: str | None = None,
        cache_retention: str | None = None,
        prediction: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> OutputStream:
        """Validate and enqueue; raises InvalidRequestError, ContextLengthError or OverloadedError
        before any output, so the API can answer 400/429 before a stream starts. `prediction`:
        text the answer is expected to repeat (Predicted Outputs), drafted from. `kv_transfer`:
        vLLM's `kv_transfer_params` (keep the prompt's KV for, or pull it from, a replica)."""
        ...

    def kv_transfer_params(self, request_id: str) -> KVTransferParams | None:
        """The `kv_transfer_params` answering a finished `do_remote_decode` request."""
        ...

    def abort(self, request_id: str) -> bool: ...
