"""`FramePacer`: how many tokens a stream's reader waits for before it is woken.

Each wake-up costs the event loop a frame: the reader takes its delta, encodes an SSE event and
writes it to its socket. With a few streams that is nothing next to a step, and every token is
its own frame. With hundreds of streams sharing quick steps, one frame per stream per step costs
the loop more than the step itself, and the loop, not the device, sets the pace. So past
`frames_per_step` streams in a step, each reader is woken once for `ceil(streams /
frames_per_step)` tokens: the loop writes at most about `frames_per_step` frames a step and each
carries more text. Text, token ids, usage and stop strings are unchanged: only how the stream is
cut into frames changes (clients see fewer, larger deltas, as a slow reader already does).

Two bounds keep latency what it was: the first token is never held back (time to first token),
and a token never waits longer than `max_delay_s` (a timer wakes what is overdue; a lane whose
steps are slower than that never holds anything back).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FramePacer:
    frames_per_step: int = 16
    """Streams a step may wake one token at a time; 0: every token wakes its reader."""
    max_delay_s: float = 0.05
    """Longest a token waits for its reader to be woken."""
    _last_step: dict[str, float] = field(default_factory=dict, repr=False)
    """Each lane's last step (a prefill step between two slow decode steps must not make them
    look quick)."""

    def tokens_per_frame(self, num_streams: int, now: float, lane: str = "") -> int:
        """Tokens a reader gathers before it is woken, for a step of `lane` delivering to
        `num_streams` streams at `now` (monotonic seconds)."""
        since = now - self._last_step.get(lane, float("-inf"))
        self._last_step[lane] = now
        budget = self.frames_per_step
        if budget <= 0 or num_streams <= budget or since >= self.max_delay_s:
            return 1
        return -(-num_streams // budget)
