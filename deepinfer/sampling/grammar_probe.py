"""`GrammarProbe`: every new grammar is built first in a child process, where a grammar that
crashes the grammar library (its compiler overflows the stack on a schema whose references chain
a thousand deep), runs past the time budget or bloats memory costs only that child.

The child builds the grammar exactly as the engine will (`grammar.build_start`, same library and
limits, on a thread with `PROBE_STACK_BYTES` of stack where the engine's have twice that) and
computes two first masks from fresh copies (the library gives up on some lexers only on the
second). It answers with the library's refusal, or with the bytes the grammar holds: the heap in
use after minus before, measured in a process that does nothing else. The child starts on the
first grammar (a second or so: its imports and the library's tokenizer) and is replaced after a
crash or a time-out; it runs at a lower priority than the server's workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection

from deepinfer.request import StructuredKind
from deepinfer.sampling.grammar import (
    COMPILE_NICENESS,
    PROBE_STACK_BYTES,
    GrammarError,
    build_start,
    llg_tokenizer,
    run_on_stack,
)
from deepinfer.sampling.vocabulary import GrammarVocabulary

START_TIMEOUT_S = 120.0
"""How long the child may take to start (imports and the tokenizer; not a grammar's budget)."""


@dataclass(frozen=True)
class ProbeResult:
    """What building one grammar in the child came to: `error` (the library's refusal, a crash or
    the time budget) or None, the bytes the built grammar holds, and the seconds it took."""

    error: str | None
    num_bytes: int
    seconds: float


class GrammarProbe:
    """The engine's side of the child. Thread-safe: one grammar is probed at a time."""

    def __init__(self, vocab: GrammarVocabulary, timeout_s: float) -> None:
        self._vocab = vocab
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._pickled_vocab: bytes | None = None
        self._finalizer: (
            weakref.finalize[[subprocess.Popen[bytes], Connection], GrammarProbe] | None
        ) = None
        self.num_crashes = 0
        """Children lost to a grammar (a signal or an exit while building it)."""
        self.num_timeouts = 0
        """Children killed for running past `timeout_s` on a grammar."""

    def check(self, kind: StructuredKind, source: str) -> ProbeResult:
        """Build the grammar in the child; blocks up to `timeout_s` (call it off the loop)."""
        with self._lock:
            conn = self._started()
            started = time.monotonic()
            conn.send((kind.value, source))
            if not conn.poll(self.timeout_s):
                self._stop()
                self.num_timeouts += 1
                budget = f"{self.timeout_s:g} s"
                return ProbeResult(f"takes longer than {budget} to compile", 0, self.timeout_s)
            try:
                result: ProbeResult = conn.recv()
            except (EOFError, OSError):
                reason = self._stop()
                self.num_crashes += 1
                return ProbeResult(
                    f"crashed the grammar compiler ({reason}); it is too deep or too large",
                    0,
                    time.monotonic() - started,
                )
            return result

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _started(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.poll() is None:
            return self._conn
        self._stop()
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", __name__, str(theirs.fileno())]
        self._process = subprocess.Popen(command, pass_fds=[theirs.fileno()], close_fds=True)
        theirs.close()
        self._conn = conn = Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _end_child, self._process, conn)
        conn.send_bytes(self._vocab_bytes())
        if not conn.poll(START_TIMEOUT_S):
            self._stop()
            raise RuntimeError(f"the grammar probe did not start within {START_TIMEOUT_S:g} s")
        conn.recv()  # "ready"
        return conn

    def _vocab_bytes(self) -> bytes:
        """The vocabulary pickled once (3 MB for SmolLM2, ~0.1 s holding the GIL): a child that
        replaces a crashed one gets the same bytes, sent without the GIL."""
        if self._pickled_vocab is None:
            self._pickled_vocab = pickle.dumps(self._vocab, protocol=pickle.HIGHEST_PROTOCOL)
        return self._pickled_vocab

    def _stop(self) -> str:
        """Stop the child (if any); says how it ended."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if process is None or conn is None:
            return "no child"
        return _end_child(process, conn)


def _end_child(process: subprocess.Popen[bytes], conn: Connection) -> str:
    """Close the connection, kill the child if it still runs, reap it; says how it ended."""
    conn.close()
    if process.poll() is None:
        process.kill()
    try:
        return _ending(process.wait(5.0))
    except subprocess.TimeoutExpired:
        return _ending(None)


def _ending(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-exitcode).name
        return f"signal {-exitcode}"
    return f"exit status {exitcode}"


# -- the child --
def child_main(conn: Connection) -> None:
    """Serve probes until the engine closes its end of the connection (the vocabulary first)."""
    with contextlib.suppress(OSError):
        os.nice(COMPILE_NICENESS)
    vocab: GrammarVocabulary = pickle.loads(conn.recv_bytes())
    tokenizer = llg_tokenizer(vocab)
    conn.send("ready")
    while True:
        try:
            kind, source = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_probe(StructuredKind(kind), source, tokenizer))


def _probe(kind: StructuredKind, source: str, tokenizer: object) -> ProbeResult:
    started = time.monotonic()
    before = heap_in_use_bytes()
    try:
        start = run_on_stack(
            lambda: build_start(kind, source, tokenizer, num_warm_masks=2),  # type: ignore[arg-type]
            PROBE_STACK_BYTES,
        )
    except GrammarError as exc:
        return ProbeResult(str(exc), 0, time.monotonic() - started)
    num_bytes = max(heap_in_use_bytes() - before, len(source))
    del start
    return ProbeResult(None, num_bytes, time.monotonic() - started)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use_bytes() -> int:
    """Bytes the C heap has handed out (glibc's `mallinfo2`, every arena); where it is missing,
    the resident set size (which only grows, so it over-counts a grammar built after others)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return _resident_bytes()
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


if __name__ == "__main__":
    # Through the module's own name, so what the child pickles names `deepinfer...`, not `__main__`.
    from deepinfer.sampling import grammar_probe

    grammar_probe.child_main(Connection(int(sys.argv[1])))
