"""Stop strings on streamed text.

`StopStringMatcher` holds back the longest tail of the text that could still begin a stop string,
so no part of a stop string is ever emitted. The stop that wins is the one that *ends* first in the
text (the one a character-by-character stream would see first); among stops ending at the same
place, the longest. This makes the result independent of how the text was split into pushes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.errors import InvalidRequestError


@dataclass(frozen=True)
class StopResult:
    """What one push releases. Once `matched` is set the stream is over: later pushes emit ""."""

    text_to_emit: str
    matched: str | None = None


class StopStringMatcher:
    """Finds the first stop string in a text stream.

    Set-up and memory are O(total length of the stops): nothing is derived from them. A push
    searches `held + text` once per stop (`str.find`), then finds the tail to hold back by
    checking, longest first, the places in that tail where a stop's first character occurs.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        for i, stop in enumerate(stops):
            if not stop:
                raise InvalidRequestError("stop strings must not be empty", param=f"stop[{i}]")
        self._stops = tuple(dict.fromkeys(stops))
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> StopResult:
        """Add streamed text; return what can be shown now, and the stop string if one matched."""
        if self.matched is not None:
            return StopResult("", self.matched)
        buffer = self._held + text
        hit = self._first_match(buffer)
        if hit is not None:
            start, stop = hit
            self._held = ""
            self.matched = stop
            return StopResult(buffer[:start], stop)
        keep = self._held_back_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return StopResult(buffer[: len(buffer) - keep])

    def flush(self) -> str:
        """Release the held-back text when generation ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def check_integrity(self) -> None:
        """The held tail is always a proper prefix of some stop string, and holds no stop."""
        held = self._held
        assert held == "" or any(len(held) < len(s) and s.startswith(held) for s in self._stops)
        assert len(held) < max(self._max_len, 1)
        assert not any(s in held for s in self._stops)

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop) of the stop ending first in `buffer`, the longest on ties."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                best = key if best is None or key < best else best
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _held_back_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop."""
        keep = 0
        for stop in self._stops:
            keep = max(keep, _overlap(buffer, stop, keep))
        return keep


def _overlap(text: str, stop: str, floor: int) -> int:
    """Length of the longest suffix of `text` longer than `floor` that is a proper prefix of
    `stop`; 0 when there is none.

    Only a suffix starting with `stop[0]` can qualify: those starts are found with `str.find`,
    from the longest suffix down, and each is checked with one comparison."""
    end = len(text)
    pos = text.find(stop[0], max(0, end - len(stop) + 1), end - floor)
    while pos != -1:
        if stop.startswith(text[pos:]):
            return end - pos
        pos = text.find(stop[0], pos + 1, end - floor)
    return 0
