"""The long-text thread: texts past `LONG_TEXT_CHARS` are handled there, at a lower CPU priority
than the engine's threads, and `tokenizers` does the work on that thread (its own pool off)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from deepinfer.engine.prompts import off_loop
from deepinfer.text import long_texts
from deepinfer.text.tokenizer import PARALLELISM_ENV, Tokenizer

linux = pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")


def _where() -> tuple[int, int]:
    tid = threading.get_native_id()
    return tid, os.getpriority(os.PRIO_PROCESS, tid)


@linux
async def test_long_work_runs_on_a_lower_priority_thread() -> None:
    here = _where()
    assert await off_loop(long_texts.LONG_TEXT_CHARS, _where) == here  # short: inline
    tid, niceness = await off_loop(long_texts.LONG_TEXT_CHARS + 1, _where)
    assert tid != here[0]
    assert niceness == min(here[1] + long_texts.NICENESS, 19)
    assert os.getpriority(os.PRIO_PROCESS, here[0]) == here[1]  # the loop's thread untouched
    assert (await off_loop(10**6, _where))[0] == tid  # one thread, reused


def test_tokenizers_pool_is_off_unless_the_environment_says(
    smollm_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build() -> str:
        Tokenizer(
            smollm_tokenizer._special,
            bos_token_id=None, eos_token_id=None, add_bos=False, chat_template=None,
        )  # fmt: skip
        return os.environ[PARALLELISM_ENV]

    monkeypatch.delenv(PARALLELISM_ENV, raising=False)
    assert build() == "false"
    monkeypatch.setenv(PARALLELISM_ENV, "true")
    assert build() == "true"
