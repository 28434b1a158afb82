"""docs/configuration.md, generated from `Config` and the command line that `args` derives from it.

`python -m deepinfer.config_docs > docs/configuration.md` rewrites the page; a test fails when the
committed page differs from what this prints. Sections follow `deepinfer serve --help-all`: one
per record of `Config` (its docstring first), the advanced tuning group, then the flags of the
commands that are not `Config` fields.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from deepinfer import cli, pull
from deepinfer.args import ALIASES, FlagSpec, flag_specs

COMMAND = "python -m deepinfer.config_docs > docs/configuration.md"

HEADER = f"""# Configuration

Every setting of the engine and server is a field of `Config` (`deepinfer/config.py`,
`deepinfer/server_config.py`), one frozen record per concern, and every field is one flag of
`deepinfer serve` (and `python server.py`). `deepinfer generate` and `deepinfer chat` take the
same flags less the server's. Every flag can also come from the environment as
`DEEPINFER_<FLAG>`, dashes as underscores (`DEEPINFER_KV_MEMORY_GB=2`); an on/off flag takes `1`
or `0`, and `DEEPINFER_NO_<FLAG>=1` is `--no-<flag>`. A flag beats the environment, which beats
the default. When embedding the engine, build the records in code:
`Config(cache=CacheConfig(block_size=32))`.

`--help` lists every group but the advanced tuning one, whose defaults were measured
(bench/RESULTS.md) and are the product; `--help-all` lists every flag.

This page is generated from the fields' docstrings: `{COMMAND}`.
"""


def render() -> str:
    """The whole page."""
    serve = _subcommands()["serve"]
    specs = {spec.dest: spec for spec in flag_specs()}
    parts = [HEADER]
    for group in serve._action_groups:
        rows = [_config_row(a, specs) for a in group._group_actions if a.dest in specs]
        if rows:
            parts.append(_section(group.title or "", group.description, _CONFIG_HEAD, rows))
    parts.append(
        _section(
            "commands",
            "Flags of the commands themselves, not fields of `Config`.",
            "| flag | commands | default | description |\n| --- | --- | --- | --- |",
            list(_command_rows(set(specs))),
        )
    )
    return "\n".join(parts)


_CONFIG_HEAD = "| flag | field | default | description |\n| --- | --- | --- | --- |"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser({})
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {**{n: p for n, p in action.choices.items() if n != "pull"}, "pull": pull.build_parser()}


def _section(title: str, description: str | None, head: str, rows: list[str]) -> str:
    text = f"## {title}\n\n"
    if description:
        text += " ".join(description.split()) + "\n\n"
    return text + head + "\n" + "\n".join(rows) + "\n"


def _config_row(action: argparse.Action, specs: dict[str, FlagSpec]) -> str:
    spec = specs[action.dest]
    alias = next((a for a in action.option_strings if a in ALIASES), None)
    if alias is not None:
        value = ALIASES[alias][1]
        return _row(alias, f"`{spec.dest}`", f"`{value}`", f"Same as `{spec.flag} {value}`.")
    note = spec.conversion.note if spec.conversion is not None else ""
    default = f"`{spec.show(spec.default)}`"
    return _row(_flags(action), f"`{spec.dest}`", default, f"{spec.doc} {note}".strip())


def _command_rows(config_dests: set[str]) -> Iterator[str]:
    seen: dict[tuple[str, str | None], tuple[list[str], argparse.Action]] = {}
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if action.dest in config_dests:
                continue
            flags = _flags(action) if action.option_strings else action.dest
            seen.setdefault((flags, action.help), ([], action))[0].append(name)
    for (flags, _), (commands, action) in seen.items():
        default = action.default if action.default is not argparse.SUPPRESS else None
        shown = "" if action.nargs == 0 or not action.option_strings else f"`{default}`"
        text = str(action.help) if action.help not in (None, argparse.SUPPRESS) else ""
        text = text[:1].upper() + text[1:] + ("." if text and not text.endswith(".") else "")
        if action.choices:
            text = f"{text} One of {', '.join(f'`{c}`' for c in action.choices)}.".strip()
        yield _row(flags, ", ".join(commands), shown, text)


def _flags(action: argparse.Action) -> str:
    return " / ".join(action.option_strings)


def _row(flag: str, *cells: str) -> str:
    return "| " + " | ".join([f"`{flag}`", *(c.replace("|", "\\|") for c in cells)]) + " |"


if __name__ == "__main__":
    sys.stdout.write(render())
