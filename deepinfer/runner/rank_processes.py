"""The processes of a machine's torch.distributed ranks (expert parallel, tensor parallel):
started with `spawn` (a fresh interpreter each: no forked threads or CUDA state), each running
`target(config, model path, rank, local rank)`, and joined or, past a timeout, terminated."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from deepinfer.config import Config

log = logging.getLogger(__name__)

RankMain = Callable[[Config, str, int, int], None]


def spawn_ranks(
    target: RankMain, config: Config, path: Path, ranks: range, name: str
) -> list[BaseProcess]:
    """Start `ranks` but rank 0 (the serving process's), each as process `{name}{rank}`."""
    context = multiprocessing.get_context("spawn")
    processes: list[BaseProcess] = []
    for rank in ranks:
        if rank != 0:
            process = context.Process(
                target=target, args=(config, str(path), rank, rank - ranks.start),
                name=f"{name}{rank}",
            )  # fmt: skip
            process.start()
            processes.append(process)
    return processes


def join_ranks(processes: Sequence[BaseProcess], timeout_s: float | None) -> None:
    """Wait for each to end; terminate one still running after `timeout_s`."""
    for process in processes:
        process.join(timeout_s)
        if process.is_alive():
            log.warning("rank process %s (%s) did not stop; terminating it",
                        process.name, process.pid)  # fmt: skip
            process.terminate()
            process.join(5)
