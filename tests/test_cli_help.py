"""`--help` lists every group but the tuning knobs, named in one line; `--help-all` lists all."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from deepinfer import cli
from deepinfer.args import TUNING, TUNING_TITLE, config_from_args, flag_specs

TUNING_FLAGS = [spec.flag for spec in flag_specs() if spec.dest in TUNING]
COMMANDS = [["serve"], ["generate", "a prompt"], ["chat"]]


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.build_parser({}).parse_args(argv)
    assert exit_info.value.code == 0
    return out.getvalue()


def _words(text: str) -> set[str]:
    return {word.strip("[],") for word in text.split()}


def test_tuning_names_fields_that_exist() -> None:
    assert len(TUNING_FLAGS) == len(TUNING) >= 10


@pytest.mark.parametrize("command", [c[0] for c in COMMANDS])
def test_help_omits_the_tuning_flags_and_points_to_help_all(command: str) -> None:
    short = _help([command, "--help"])
    assert _help([command, "-h"]) == short
    assert not _words(short) & set(TUNING_FLAGS), sorted(_words(short) & set(TUNING_FLAGS))
    assert f"{TUNING_TITLE}:" in short and "--help-all lists them" in short
    assert "--block-size" in short and "--model" in short


@pytest.mark.parametrize("command", [c[0] for c in COMMANDS])
def test_help_all_lists_every_flag(command: str) -> None:
    full = _help([command, "--help-all"])
    assert set(TUNING_FLAGS) <= _words(full)
    assert f"{TUNING_TITLE}:" in full and "--help-all lists them" not in full


def test_help_leaves_the_parser_whole() -> None:
    parser = cli.build_parser({})
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = action.choices["serve"]
    before = serve.format_help()
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert serve.format_help() == before


@pytest.mark.parametrize(
    ("argv", "path", "value"),
    [
        (["--gil-switch-interval-ms", "2"], ("workers", "gil_switch_interval_ms"), 2.0),
        (["--stream-frames-per-step", "4"], ("scheduler", "stream_frames_per_step"), 4),
        (["--prefill-buckets", "64,128"], ("workers", "prefill_buckets"), (64, 128)),
        (["--threads", "3"], ("runtime", "num_threads"), 3),
    ],
)
def test_a_tuning_flag_still_parses(argv: list[str], path: tuple[str, str], value: object) -> None:
    config = config_from_args(cli.build_parser({}).parse_args(["serve", *argv]))
    assert getattr(getattr(config, path[0]), path[1]) == value


def test_tuning_defaults_are_unchanged() -> None:
    config = config_from_args(cli.build_parser({}).parse_args(["serve"]))
    assert config.workers.gil_switch_interval_ms == 0.5
    assert config.workers.gc_young_threshold == 50_000
    assert config.scheduler.stream_frames_per_step == 16
