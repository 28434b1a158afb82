"""docs/configuration.md is what `deepinfer.config_docs` generates, and names every flag."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from deepinfer import cli, config_docs, pull
from deepinfer.args import TUNING, flag_specs

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def test_the_committed_page_is_the_generated_one() -> None:
    assert PAGE.read_text() == config_docs.render(), (
        f"docs/configuration.md is stale; regenerate it: {config_docs.COMMAND}"
    )


def _every_parser() -> list[argparse.ArgumentParser]:
    parser = cli.build_parser({})
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [*action.choices.values(), pull.build_parser()]


def test_every_flag_of_every_command_is_on_the_page() -> None:
    page = config_docs.render()
    flags = {s for p in _every_parser() for a in p._actions for s in a.option_strings}
    assert len(flags) > 80
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){f}(?![\w-])", page))
    assert not missing, missing


def test_every_field_is_on_the_page_with_its_docstring() -> None:
    page = config_docs.render()
    for spec in flag_specs():
        assert f"`{spec.dest}`" in page, spec.dest
        assert spec.doc.replace("|", "\\|") in page, spec.dest


def test_the_tuning_flags_have_their_own_section() -> None:
    page = config_docs.render()
    tuning = page.split("## advanced tuning", 1)[1].split("\n## ", 1)[0]
    assert {s.dest for s in flag_specs() if f"`{s.dest}`" in tuning} == TUNING
