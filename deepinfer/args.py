"""Command-line flags derived from the `Config` dataclasses, and the `Config` they parse to.

Every field of every section of `Config` is one flag (a nested record such as
`ServerConfig.limits` adds its fields too). The flag is the field's name with dashes (`RENAMED`
keeps the older names users rely on), its choices come from a `Literal` or enum type, a bool gets
`--x/--no-x`, a tuple takes a comma list, and its help is the field's docstring where the section is defined
(config.py, server_config.py).
`CONVERSIONS` holds the flags whose text is not the field's value (`--kv-memory-gb` ->
`kv_memory_bytes`). Every flag also reads `DEEPINFER_<FLAG>` (`config.env_name`; a bool also
`DEEPINFER_NO_<FLAG>`): a flag beats the environment, which beats the field's default. A field
set by neither is left out, so the dataclass default applies. The flags of `TUNING`, whose
defaults were measured, form one last group that `--help` names in one line and `--help-all`
lists.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import sys
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from deepinfer.config import Config
from deepinfer.environment import env_name, env_value
from deepinfer.errors import ConfigError

GIB = 1 << 30
Parse = Callable[[str], Any]
Environ = Mapping[str, str] | None


@dataclass(frozen=True)
class Conversion:
    """A flag whose text is not its field's value: `parse` reads the text, `show` writes a field
    value the way the flag takes it, `note` says how in the help."""

    flag: str
    parse: Parse
    show: Callable[[Any], str]
    note: str


def _gib(text: str) -> int:
    try:
        return int(float(text) * GIB)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None


def _zero_is_none(text: str) -> float | None:
    return float(text) or None


def _zero_is_none_int(text: str) -> int | None:
    return int(text) or None


def _in_gib(flag: str) -> Conversion:
    return Conversion(flag, _gib, lambda num_bytes: f"{num_bytes / GIB:g}", "In GiB.")


RENAMED = {
    "model.path": "--model",
    "runtime.num_threads": "--threads",
    "cache.enable_prefix_caching": "--prefix-caching",
    "disk_cache.enabled": "--disk-cache",
    "host_cache.enabled": "--host-cache",
}
"""Flags not named after their field (dotted path below `Config` -> flag)."""

CONVERSIONS = {
    "cache.kv_memory_bytes": _in_gib("--kv-memory-gb"),
    "disk_cache.max_bytes": _in_gib("--disk-cache-gb"),
    "host_cache.max_bytes": _in_gib("--host-cache-gb"),
    "workers.gc_young_threshold": Conversion(
        "--gc-young-threshold", _zero_is_none_int, str, "0 means None."
    ),
    "workers.gil_switch_interval_ms": Conversion(
        "--gil-switch-interval-ms", _zero_is_none, str, "0 means None."
    ),
}

ALIASES = {"--no-host-cache": ("host_cache.enabled", "off")}
"""Flags that set another flag's field to a constant (flag -> (dotted path, value))."""

TUNING = frozenset(
    {
        "runtime.num_threads",
        "workers.prefill_threads",
        "workers.decode_threads",
        "workers.lend_idle_threads",
        "workers.prefill_step_ms",
        "workers.prefill_buckets",
        "workers.prefill_max_batched_tokens",
        "workers.gc_young_threshold",
        "workers.gil_switch_interval_ms",
        "scheduler.stream_frames_per_step",
        "scheduler.stream_max_delay_ms",
        "speculative.num_draft_tokens",
        "speculative.speculative_gate",
        "cache.num_blocks",
    }
)
"""Fields whose defaults were measured (bench/RESULTS.md) and are the product: their flags form
one `advanced tuning` group that `--help` names in one line and `--help-all` lists."""

TUNING_TITLE = "advanced tuning"
TUNING_DOC = (
    "Defaults measured on this engine (bench/RESULTS.md); change them to measure, "
    "not to configure a deployment."
)

SERVER_SECTIONS = ("server",)
ENGINE_SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in SERVER_SECTIONS)
ALL_SECTIONS = ENGINE_SECTIONS + SERVER_SECTIONS

_TUNING_GROUPS: weakref.WeakKeyDictionary[
    argparse.ArgumentParser, tuple[argparse._ArgumentGroup, list[argparse.Action]]
] = weakref.WeakKeyDictionary()
"""Each parser's tuning group and its flags, for `short_help`."""


@dataclass(frozen=True)
class FlagSpec:
    """One field of `Config` as a flag."""

    dest: str
    """Dotted path below `Config`, e.g. `cache.block_size` or `server.limits.max_tools`."""
    owner: type
    """The record that holds the field."""
    flag: str
    hint: Any
    """The field's type, `None` taken out of a union."""
    default: Any
    doc: str
    """The field's docstring, whitespace collapsed."""

    @property
    def conversion(self) -> Conversion | None:
        return CONVERSIONS.get(self.dest)

    @property
    def env(self) -> str:
        return env_name(self.flag[2:])

    @property
    def choices(self) -> list[Any] | None:
        if typing.get_origin(self.hint) is Literal:
            return list(typing.get_args(self.hint))
        if isinstance(self.hint, type) and issubclass(self.hint, Enum):
            return list(self.hint)
        return None

    @property
    def parse(self) -> Parse:
        if self.conversion is not None:
            return self.conversion.parse
        if typing.get_origin(self.hint) is Literal:
            return str
        if typing.get_origin(self.hint) is tuple:
            return _comma_list(typing.get_args(self.hint)[0])
        if self.hint in (int, float, str, Path) or self.choices is not None:
            return typing.cast(Parse, self.hint)
        raise TypeError(f"{self.dest}: no flag for type {self.hint!r}; teach deepinfer/args.py")

    def show(self, value: Any) -> str:
        """`value` as this flag's text."""
        if value is None or isinstance(value, bool):
            return str(value)
        if self.conversion is not None:
            return self.conversion.show(value)
        if isinstance(value, tuple):
            return ",".join(map(str, value)) or "empty"
        return str(value)


def _comma_list(item: Parse) -> Parse:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(item(part.strip()) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"takes comma-separated {getattr(item, '__name__', 'value')}s, got {text!r}"
            ) from None

    return parse


@functools.cache
def flag_specs(section: type = Config, prefix: str = "") -> tuple[FlagSpec, ...]:
    """Every field below `section` as a flag, in declaration order."""
    hints, docs = _hints(section), field_docs(section)
    specs: list[FlagSpec] = []
    for f in dataclasses.fields(section):
        dest, hint = prefix + f.name, _without_none(hints[f.name])
        if dataclasses.is_dataclass(hint):
            specs += flag_specs(typing.cast(type, hint), dest + ".")
            continue
        flag = RENAMED.get(dest) or "--" + f.name.replace("_", "-")
        conversion = CONVERSIONS.get(dest)
        flag = conversion.flag if conversion is not None else flag
        default = f.default_factory() if callable(f.default_factory) else f.default
        specs.append(FlagSpec(dest, section, flag, hint, default, docs.get(f.name, "")))
    return tuple(specs)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _without_none(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a class (the string under each field), read from its source."""
    body, docs = _class_node(cls).body, {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def class_doc(cls: type) -> str | None:
    """A class's own docstring (a dataclass's `__doc__` is its signature when it has none)."""
    doc = ast.get_docstring(_class_node(cls))
    return " ".join(doc.split()) if doc else None


@functools.cache
def _class_node(cls: type) -> ast.ClassDef:
    source = inspect.getsourcefile(cls)
    for node in _module_ast(source or "").body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    raise LookupError(f"no source for class {cls.__qualname__}")


@functools.cache
def _module_ast(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text())


def add_flag(
    group: argparse._ActionsContainer, flag: str, environ: Environ = None, **kwargs: Any
) -> argparse.Action:
    """`group.add_argument(flag, **kwargs)`, its default read from `DEEPINFER_<FLAG>` when set
    there (converted and checked as the flag would be; a bad value raises `ConfigError`)."""
    value = _from_env(flag[2:], kwargs, environ)
    if value is not _UNSET:
        kwargs["default"] = value
    return group.add_argument(flag, **kwargs)


_UNSET: Any = object()


def _from_env(name: str, kwargs: Mapping[str, Any], environ: Environ) -> Any:
    action = kwargs.get("action")
    if action in ("store_true", argparse.BooleanOptionalAction):
        return env_bool(name, environ, negatable=action is argparse.BooleanOptionalAction)
    text = env_value(name, environ)
    if text is None:
        return _UNSET
    try:
        value = kwargs.get("type", str)(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{env_name(name)}={text!r}: {exc}") from None
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(
            f"{env_name(name)}={text!r}: choose one of {', '.join(map(str, choices))}"
        )
    return value


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_bool(name: str, environ: Environ = None, *, negatable: bool = False) -> Any:
    """`DEEPINFER_<NAME>` as a bool (and the inverse of `DEEPINFER_NO_<NAME>` when `negatable`);
    `_UNSET` when neither is set."""
    found: dict[str, bool] = {}
    for key, invert in ((name, False), ("no-" + name, True))[: 2 if negatable else 1]:
        text = env_value(key, environ)
        if text is None:
            continue
        if text.strip().lower() not in _TRUE + _FALSE:
            raise ConfigError(f"{env_name(key)}={text!r}: use one of {', '.join(_TRUE + _FALSE)}")
        found[env_name(key)] = (text.strip().lower() in _TRUE) != invert
    if len(set(found.values())) > 1:
        raise ConfigError(f"{' and '.join(found)} disagree")
    return next(iter(found.values()), _UNSET)


def add_config_args(
    parser: argparse.ArgumentParser, sections: Sequence[str], environ: Environ = None
) -> None:
    """The flags of `sections` (field names of `Config`), one argument group per record, then
    the tuning knobs among them in one last group (`TUNING`)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    specs = [spec for spec in flag_specs() if spec.dest.split(".")[0] in sections]
    tuning: list[argparse.Action] = []
    for spec in sorted(specs, key=lambda spec: spec.dest in TUNING):
        owner = TUNING_TITLE if spec.dest in TUNING else spec.dest.rpartition(".")[0]
        if owner not in groups:
            title = owner.replace(".", " ").replace("_", " ")
            doc = TUNING_DOC if spec.dest in TUNING else class_doc(spec.owner)
            groups[owner] = parser.add_argument_group(title, doc)
        actions = _add_spec(groups[owner], spec, environ)
        if spec.dest in TUNING:
            tuning += actions
    if tuning:
        _TUNING_GROUPS[parser] = (groups[TUNING_TITLE], tuning)


def add_help_flags(parser: argparse.ArgumentParser) -> None:
    """`-h/--help` (every group but the tuning knobs, which get one line) and `--help-all`
    (everything), on a parser made with `add_help=False`."""
    parser.add_argument(
        "-h", "--help", action=_ShortHelp, help="show this help (less the tuning knobs) and exit"
    )
    parser.add_argument(
        "--help-all", action="help", help="show this help with the advanced tuning flags and exit"
    )


def short_help(parser: argparse.ArgumentParser) -> str:
    """`parser`'s help with the tuning group reduced to its title and a line naming
    `--help-all`; the parser is as it was afterwards."""
    if parser not in _TUNING_GROUPS:
        return parser.format_help()
    group, actions = _TUNING_GROUPS[parser]
    description = group.description
    helps = [action.help for action in actions]
    try:
        for action in actions:
            action.help = argparse.SUPPRESS
        group.description = f"{len(actions)} flags with measured defaults: --help-all lists them."
        return parser.format_help()
    finally:
        for action, text in zip(actions, helps, strict=True):
            action.help = text
        group.description = description


class _ShortHelp(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        sys.stdout.write(short_help(parser))
        parser.exit()


def _add_spec(
    group: argparse._ArgumentGroup, spec: FlagSpec, environ: Environ
) -> list[argparse.Action]:
    """The flag of `spec` (and any alias of it) in `group`; the actions added."""
    kwargs: dict[str, Any] = {"dest": spec.dest, "default": argparse.SUPPRESS}
    if spec.hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"], kwargs["choices"] = spec.parse, spec.choices
        if spec.choices is None:
            kwargs["metavar"] = spec.flag[2:].upper().replace("-", "_")
    note = spec.conversion.note if spec.conversion is not None else ""
    text = f"{spec.doc} {note} [default: {spec.show(spec.default)}; env {spec.env}]"
    action = add_flag(group, spec.flag, environ, help=text.strip().replace("%", "%%"), **kwargs)
    added = [action]
    for alias, (dest, value) in ALIASES.items():
        if dest == spec.dest:
            if env_bool(alias[2:], environ) is True:
                action.default = value
            alias_action = group.add_argument(
                alias,
                dest=dest,
                action="store_const",
                const=value,
                default=argparse.SUPPRESS,
                help=f"same as {spec.flag} {value} [env {env_name(alias[2:])}]",
            )
            added.append(alias_action)
    return added


def add_engine_args(parser: argparse.ArgumentParser, environ: Environ = None) -> None:
    """Flags of every section but the server's (`generate`, `chat`, `serve`)."""
    add_config_args(parser, ENGINE_SECTIONS, environ)


def add_serve_config_args(parser: argparse.ArgumentParser, environ: Environ = None) -> None:
    """Flags of every section, the server's and its request limits' included (`serve`)."""
    add_config_args(parser, ALL_SECTIONS, environ)


def config_from_args(ns: argparse.Namespace) -> Config:
    """The `Config` that parsed flags describe (flag, else environment, else default)."""
    return typing.cast(Config, _build(Config, "", vars(ns)))


def _build(cls: type, prefix: str, values: Mapping[str, Any]) -> Any:
    hints, kwargs = _hints(cls), {}
    for f in dataclasses.fields(cls):
        dest, hint = prefix + f.name, _without_none(hints[f.name])
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(typing.cast(type, hint), dest + ".", values)
        elif dest in values:
            kwargs[f.name] = values[dest]
    return cls(**kwargs)
