"""Where texts too long for the event loop are tokenized: one thread of its own, at a lower CPU
priority than the engine's.

A 3 MB text takes about a second to tokenize. On the loop that second stops every stream; on a
thread it competes for the cores with the workers' forward passes, whose OpenMP teams wait for
their slowest thread at every barrier, so one busy thread beside them stretches every step (a
victim stream's largest gap went from 20 to 107 ms beside 3 MB `/tokenize` requests). At
`NICENESS` the kernel runs it on whatever the engine leaves and preempts it as soon as a step's
threads wake (it still takes a whole core when the engine is idle). `tokenizers`' own thread
pool, which the batch call would hand the work to at normal priority, is off
(`Tokenizer.__init__` sets `TOKENIZERS_PARALLELISM=false` unless the environment says otherwise),
so the work runs on this thread. One thread: long texts wait for each other rather than take
more of the machine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

LONG_TEXT_CHARS = 8192
"""Texts (or conversations, or id lists) longer than this are handled on `executor()`."""
NICENESS = 10
"""How much lower the thread's priority is than the process's (Linux: per thread)."""


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # elsewhere: a per-process call, or none
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS)


@functools.cache
def executor() -> ThreadPoolExecutor:
    """The process's long-text thread (made on first use, kept for the process's life)."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="deepinfer-long-text", initializer=_lower_priority
    )
