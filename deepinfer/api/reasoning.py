"""Reasoning in answers: whether a request's answer is split into reasoning and content, and
the splitter each choice reads its deltas through (`text/reasoning.py`).

A recipe with a `ReasoningFormat` (Qwen3, DeepSeek-R1-distill) has its answers split by the
think-marker ids the model samples; the others answer in content only. The answer starts inside
the block when the generation prompt opened it (R1), never when a final message is continued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.api.prompt_options import PromptOptions
from deepinfer.api.protocol import TokenizerLike
from deepinfer.text.reasoning import ReasoningFormat, ReasoningSplitter


@dataclass(frozen=True)
class ReasoningPlan:
    fmt: ReasoningFormat | None = None
    opens: bool = False
    """The prompt ends inside an open think block."""

    def splitter(self, tokenizer: TokenizerLike) -> ReasoningSplitter | None:
        """A new splitter for one choice, or None when answers are content only."""
        if self.fmt is None:
            return None

        def decode(ids: Sequence[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        return ReasoningSplitter(self.fmt, decode, self.opens)


NO_REASONING = ReasoningPlan()


def reasoning_plan(recipe: object, options: PromptOptions) -> ReasoningPlan:
    fmt = getattr(recipe, "reasoning", None)
    if not isinstance(fmt, ReasoningFormat):
        return NO_REASONING
    opens = fmt.prompt_opens and options.add_generation_prompt
    return ReasoningPlan(fmt, opens and not options.continue_final_message)
