"""Predicted outputs: the client's own draft of the answer (OpenAI's `prediction`), as a proposer.

An edit returns most of a file the client already holds: the request carries that text as
`Request.predicted_token_ids`, and each decode step verifies the prediction's next tokens as
drafts, keeping those the model agrees with. The output is the model's own, token for token (the
verification keeps only what plain decoding would have picked); the prediction only decides how
many tokens a step can produce.

Alignment: a cursor into the prediction follows the output token by token while the two agree;
where they part (an edited line), the cursor is lost, and found again at the next place the
output's last tokens (`MAX_MATCH` down to `MIN_MATCH` of them) occur in the prediction: the first
occurrence at or after where it was lost (an edit goes forward through the file), else the first
anywhere. Until then the request drafts as the configured proposer says, if any
(`scheduler/drafting.py`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from deepinfer.request import Request
from deepinfer.scheduler.draft_gate import LONG_DRAFT_TOKENS, Draft

MAX_MATCH = 8
"""Longest run of the output's last tokens looked up in the prediction when realigning."""
MIN_MATCH = 2
"""Shortest such run: one token (a newline, a bracket) occurs everywhere in code."""
PREDICTION_DRAFT_TOKENS = LONG_DRAFT_TOKENS
"""Most drafts a step verifies from a prediction: its drafts are accepted far more often than
prompt lookup's, and the gate still cuts them to what pays."""

_WIDTH = 8  # bytes of one packed token (int64)


@dataclass
class _Alignment:
    packed: bytes
    """The prediction as int64 bytes (searched with `bytes.find`)."""
    size: int
    cursor: int | None = 0
    """Index of the prediction token expected next; None: lost."""
    lost_at: int = 0
    """Where the cursor was when it was lost (realignment looks forward from here first)."""
    seen: int = 0
    """Output tokens already followed."""


class PredictionProposer:
    """Drafts from a request's prediction (none for a request without one, or while the output
    has no place in it). `num_signals`: those of the gate it feeds (the configured proposer's),
    each 1.0 while in step, the matched run's share of `MAX_MATCH` right after a realignment."""

    name = "prediction"

    def __init__(self, num_signals: int = 1) -> None:
        self.num_signals = num_signals
        self._aligned: dict[str, _Alignment] = {}

    def propose(self, request: Request, max_tokens: int) -> Draft:
        if max_tokens <= 0 or not request.predicted_token_ids:
            return Draft()
        found, signal = self._follow(request, max_tokens)
        return Draft(found, (signal,) * self.num_signals) if found else Draft()

    def _follow(self, request: Request, max_tokens: int) -> tuple[tuple[int, ...], float]:
        """The prediction's next tokens after the output so far (none where it has no place
        in it), and the confidence signal."""
        pred = request.predicted_token_ids
        a = self._aligned.get(request.request_id)
        outputs = request.output_token_ids
        if a is None or a.seen > len(outputs):  # new, or recomputed after preemption
            a = self._aligned[request.request_id] = _Alignment(
                array("q", pred).tobytes(), len(pred)
            )
        signal = 1.0
        if a.cursor is not None:
            for t in outputs[a.seen :]:
                if a.cursor < a.size and pred[a.cursor] == t:
                    a.cursor += 1
                else:
                    a.lost_at, a.cursor = a.cursor, None
                    break
        a.seen = len(outputs)
        if a.cursor is None:
            a.cursor, n = _realign(a, outputs)
            signal = n / MAX_MATCH
            if a.cursor is None:
                return (), 0.0
        return tuple(pred[a.cursor : a.cursor + max_tokens]), signal

    def forget(self, request_id: str) -> None:
        self._aligned.pop(request_id, None)


def _realign(a: _Alignment, outputs: list[int]) -> tuple[int | None, int]:
    """(the prediction index after the first occurrence of the output's longest suffix of
    `MIN_MATCH`..`MAX_MATCH` tokens, at or after `a.lost_at` if there is one there, else
    anywhere; that suffix's length), or (None, 0)."""
    for n in range(min(MAX_MATCH, len(outputs)), MIN_MATCH - 1, -1):
        needle = array("q", outputs[-n:]).tobytes()
        for start in (max(a.lost_at - n, 0), 0):
            at = find_aligned(a.packed, needle, start * _WIDTH)
            if at >= 0:
                return at // _WIDTH + n, n
    return None, 0


def find_aligned(data: bytes | bytearray, needle: bytes, start: int) -> int:
    """`data.find(needle, start)` kept to whole tokens; -1 if none."""
    at = data.find(needle, start)
    while at >= 0 and at % _WIDTH:
        at = data.find(needle, at + 1)
    return at
