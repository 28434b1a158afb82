"""Process-wide interpreter settings the engine applies while it runs, restored at shutdown.

- The GIL switch interval (`--gil-switch-interval-ms`): a forward pass drops and retakes the GIL
  at every op or launch, and each retake can wait a whole interval while the event loop's thread
  is busy streaming.
- The cyclic garbage collector (`--gc-young-threshold`): what exists when the engine starts (the
  model, the tokenizer, every KV block's record: hundreds of thousands of objects) is frozen out
  of collection (`gc.freeze`), and the youngest generation is collected every N allocations
  instead of Python's 700. A decode step allocates a few objects per request (its chunk, its
  delta) that die within the step; at 700 the collector runs several times a step over objects
  still alive, promotes them, and every so often a full collection walks the whole heap: a pause
  of 0.1-0.2 s on the loop with the default model's pool. At 50,000 it runs every few dozen
  steps, when those objects are long gone. Unfrozen at shutdown, so an application that embeds
  the engine gets back a collector that sees everything.
"""

from __future__ import annotations

import gc
import sys

from deepinfer.config import WorkersConfig


class ProcessSettings:
    def __init__(self, config: WorkersConfig) -> None:
        self._config = config
        self._switch_interval: float | None = None
        self._gc_threshold: tuple[int, int, int] | None = None

    def apply(self) -> None:
        if (interval_ms := self._config.gil_switch_interval_ms) is not None:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(interval_ms / 1e3)
        if (young := self._config.gc_young_threshold) is not None:
            threshold = gc.get_threshold()
            self._gc_threshold = (threshold[0], threshold[1], threshold[2])
            gc.freeze()  # no collection first: in an embedding test process it can take a second
            gc.set_threshold(young, threshold[1], threshold[2])

    def restore(self) -> None:
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)
            gc.unfreeze()
            self._gc_threshold = None
