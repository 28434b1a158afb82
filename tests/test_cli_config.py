"""The command line is derived from `Config`: every field a flag, every flag a `DEEPINFER_*`
variable, the flags users know unchanged, and the claims README and the docs make about them
true."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import re
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from deepinfer import cli
from deepinfer.args import ALIASES, FlagSpec, config_from_args, field_docs, flag_specs
from deepinfer.config import CacheConfig, Config, Retention
from deepinfer.environment import env_name
from deepinfer.errors import ConfigError, InvalidRequestError
from deepinfer.tiers.kv_tiers import check_retention

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    return cli.build_parser(environ or {}).parse_args(argv)


def _config(flags: list[str], environ: dict[str, str] | None = None) -> Config:
    return config_from_args(_parse(["serve", *flags], environ))


def _with(path: str, value: object) -> Config:
    """`Config()` with the field at dotted `path` set to `value`."""

    def put(record: Any, names: list[str]) -> Any:
        child = value if len(names) == 1 else put(getattr(record, names[0]), names[1:])
        return dataclasses.replace(record, **{names[0]: child})

    return typing.cast(Config, put(Config(), path.split(".")))


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser({})
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


# Each flag `deepinfer serve` had before the parser was derived from `Config`, with what it set.
OLD_FLAGS: list[tuple[str, str, object]] = [
    ("--model /tmp/m.gguf", "model.path", Path("/tmp/m.gguf")),
    ("--dtype bfloat16", "model.dtype", "bfloat16"),
    ("--max-model-len 100", "model.max_model_len", 100),
    ("--quantized-matmul off", "model.quantized_matmul", "off"),
    ("--matmul-activations int8", "model.matmul_activations", "int8"),
    ("--device cuda:1", "runtime.device", "cuda:1"),
    ("--attention-backend triton", "runtime.attention_backend", "triton"),
    ("--cuda-graphs on", "runtime.cuda_graphs", "on"),
    ("--threads 3", "runtime.num_threads", 3),
    ("--seed 4", "runtime.seed", 4),
    ("--block-size 32", "cache.block_size", 32),
    ("--kv-dtype float16", "cache.kv_dtype", "float16"),
    ("--kv-memory-gb 0.75", "cache.kv_memory_bytes", 3 * GIB // 4),
    ("--num-blocks 9", "cache.num_blocks", 9),
    ("--no-prefix-caching", "cache.enable_prefix_caching", False),
    ("--max-num-seqs 5", "scheduler.max_num_seqs", 5),
    ("--max-num-batched-tokens 77", "scheduler.max_num_batched_tokens", 77),
    ("--max-waiting 3", "scheduler.max_waiting", 3),
    ("--cache-dir /tmp/c", "disk_cache.cache_dir", Path("/tmp/c")),
    ("--no-disk-cache", "disk_cache.enabled", False),
    ("--disk-cache-gb 1.5", "disk_cache.max_bytes", 3 * GIB // 2),
    ("--default-retention agent", "disk_cache.default_retention", "agent"),
    ("--default-retention none", "disk_cache.default_retention", "none"),
    ("--host-cache on", "host_cache.enabled", "on"),
    ("--no-host-cache", "host_cache.enabled", "off"),
    ("--host-cache on --no-host-cache", "host_cache.enabled", "off"),
    ("--host-cache-gb 0.5", "host_cache.max_bytes", GIB // 2),
    ("--colocated", "workers.colocated", True),
    ("--prefill-devices cuda:0", "workers.prefill_devices", ("cuda:0",)),
    ("--decode-devices cuda:1,cuda:2", "workers.decode_devices", ("cuda:1", "cuda:2")),
    ("--prefill-threads 2", "workers.prefill_threads", 2),
    ("--decode-threads 1", "workers.decode_threads", 1),
    ("--gil-switch-interval-ms 0", "workers.gil_switch_interval_ms", None),
    ("--gil-switch-interval-ms 2", "workers.gil_switch_interval_ms", 2.0),
    ("--no-lend-idle-threads", "workers.lend_idle_threads", False),
    ("--prefill-step-ms 30", "workers.prefill_step_ms", 30.0),
    ("--prefill-buckets 64,128", "workers.prefill_buckets", (64, 128)),
    ("--host 0.0.0.0", "server.host", "0.0.0.0"),
    ("--port 9", "server.port", 9),
    ("--api-key k", "server.api_key", "k"),
    ("--served-model-name s", "server.served_model_name", "s"),
    ("--max-body-bytes 1000", "server.max_body_bytes", 1000),
    ("--header-timeout-s 1.5", "server.header_timeout_s", 1.5),
    ("--body-timeout-s 2", "server.body_timeout_s", 2.0),
    ("--keep-alive-timeout-s 3", "server.keep_alive_timeout_s", 3.0),
    ("--max-connections 7", "server.max_connections", 7),
    ("--max-json-depth 3", "server.limits.max_json_depth", 3),
    ("--max-messages 4", "server.limits.max_messages", 4),
    ("--max-stop-strings 5", "server.limits.max_stop_strings", 5),
    ("--max-stop-string-chars 6", "server.limits.max_stop_string_chars", 6),
    ("--max-stop-token-ids 7", "server.limits.max_stop_token_ids", 7),
    ("--max-logit-bias 8", "server.limits.max_logit_bias", 8),
    ("--max-tools 9", "server.limits.max_tools", 9),
    ("--max-schema-bytes 10", "server.limits.max_schema_bytes", 10),
]


def test_no_flags_is_the_default_config() -> None:
    assert _config([]) == Config()


@pytest.mark.parametrize(("flags", "path", "value"), OLD_FLAGS, ids=[f[0] for f in OLD_FLAGS])
def test_old_flags_parse_to_the_same_config(flags: str, path: str, value: object) -> None:
    config = _config(shlex.split(flags))
    assert config == _with(path, value) != Config()


def test_every_old_flag_is_still_there() -> None:
    known = _option_strings(_subparsers()["serve"])
    old = {flags.split()[0] for flags, _, _ in OLD_FLAGS} | {"--log-level"}
    assert old <= known


def test_every_field_is_a_flag_with_its_docstring() -> None:
    specs = flag_specs()
    assert [s.dest for s in specs] == _leaf_fields(Config)
    assert len({s.flag for s in specs}) == len(specs)
    assert all(s.doc for s in specs), [s.dest for s in specs if not s.doc]
    assert field_docs(CacheConfig)["block_size"] == "Tokens per KV block."
    serve_help = _subparsers()["serve"].format_help()
    assert "Tokens per KV block." in serve_help and "DEEPINFER_KV_MEMORY_GB" in serve_help


def test_choices_come_from_the_types() -> None:
    actions = {a.dest: a for a in _subparsers()["serve"]._actions}
    assert list(actions["disk_cache.default_retention"].choices or []) == list(Retention)
    assert list(actions["model.dtype"].choices or []) == ["auto", "float32", "bfloat16", "float16"]


def _leaf_fields(cls: type, prefix: str = "") -> list[str]:
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if dataclasses.is_dataclass(hint):
            out += _leaf_fields(typing.cast(type, hint), prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


def _sample(spec: FlagSpec) -> str:
    """A valid value for the flag, not its default."""
    if spec.choices is not None:
        return str(next(c for c in reversed(spec.choices) if c != spec.default))
    if spec.conversion is not None:  # in the flag's own unit: a fraction where it takes one
        try:
            spec.conversion.parse("2.5")
        except ValueError:
            return "32"
        return "2.5"
    if typing.get_origin(spec.hint) is tuple:
        return "1,2" if typing.get_args(spec.hint)[0] is int else "a,b"
    return {int: "32", float: "2.5", str: "x1", Path: "/tmp/deepinfer-x"}[spec.hint]


EnvCase = tuple[list[str], dict[str, str], bool]


def _env_cases() -> list[EnvCase]:
    """(flags, environment, whether they change the default): each pair should give the same
    `Config`; one or more per flag (a bool `--x/--no-x` reads `DEEPINFER_X` and `..._NO_X`)."""
    cases: list[EnvCase] = []
    for spec in flag_specs():
        if spec.hint is bool:
            no = "no-" + spec.flag[2:]
            for flag, value in ((spec.flag, True), ("--" + no, False)):
                changes = value != spec.default
                cases.append(([flag], {spec.env: str(int(value))}, changes))
                cases.append(([flag], {env_name(no): str(int(not value))}, changes))
        else:
            sample = _sample(spec)
            cases.append(([spec.flag, sample], {spec.env: sample}, True))
    cases += [([alias], {env_name(alias[2:]): "1"}, True) for alias in ALIASES]
    return cases


@pytest.mark.parametrize(("flags", "environ", "changes"), _env_cases(), ids=str)
def test_environment_gives_the_same_config_as_the_flag(
    flags: list[str], environ: dict[str, str], changes: bool
) -> None:
    config = _config(flags)
    assert _config([], environ) == config
    assert (config != Config()) == changes


def test_every_flag_is_covered_by_the_environment_cases() -> None:
    covered = {flags[0] for flags, _, _ in _env_cases()}
    not_config = {"-h", "--help", "--help-all", "--log-level"}
    assert covered == _option_strings(_subparsers()["serve"]) - not_config


def _command_flag_cases() -> list[tuple[str, str, str]]:
    """(command, flag, value) for every flag that is not a `Config` field."""
    dests = {s.dest for s in flag_specs()} | {"help", "help_all"}
    cases = []
    for command, parser in _subparsers().items():
        for action in parser._actions:
            if not action.option_strings or action.dest in dests:
                continue
            if action.nargs == 0:
                value = "1"
            elif action.choices:
                value = str(next(iter(action.choices)))
            else:
                value = "32" if action.type in (int, float) else "x1"
            cases.append((command, action.option_strings[0], value))
    return cases


@pytest.mark.parametrize(("command", "flag", "value"), _command_flag_cases())
def test_command_flags_read_the_environment_too(command: str, flag: str, value: str) -> None:
    head = [command, "a prompt"] if command == "generate" else [command]
    as_flag = [flag] if value == "1" else [flag, value]
    from_flag = _parse([*head, *as_flag])
    from_env = _parse(head, {env_name(flag[2:]): value})
    assert from_flag == from_env != _parse(head)


def test_a_flag_beats_the_environment_which_beats_the_default() -> None:
    env = {"DEEPINFER_BLOCK_SIZE": "32", "DEEPINFER_NO_DISK_CACHE": "1"}
    assert _config([], env).cache.block_size == 32
    assert _config(["--block-size", "64"], env).cache.block_size == 64
    assert _config([]).cache.block_size == CacheConfig().block_size == 16
    assert not _config([], env).disk_cache.enabled
    assert _config(["--disk-cache"], env).disk_cache.enabled
    assert (
        _config(["--host-cache", "on"], {"DEEPINFER_NO_HOST_CACHE": "1"}).host_cache.enabled == "on"
    )


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DEEPINFER_PORT": "eighty"}, "DEEPINFER_PORT='eighty'"),
        ({"DEEPINFER_DTYPE": "int3"}, "DEEPINFER_DTYPE='int3': choose one of auto"),
        ({"DEEPINFER_DEFAULT_RETENTION": "forever"}, "DEEPINFER_DEFAULT_RETENTION"),
        ({"DEEPINFER_PREFILL_BUCKETS": "1,x"}, "comma-separated ints"),
        ({"DEEPINFER_DISK_CACHE": "maybe"}, "DEEPINFER_DISK_CACHE='maybe'"),
        ({"DEEPINFER_DISK_CACHE": "1", "DEEPINFER_NO_DISK_CACHE": "1"}, "disagree"),
        ({"DEEPINFER_LOG_LEVEL": "loud"}, "DEEPINFER_LOG_LEVEL"),
    ],
)
def test_a_bad_environment_value_names_its_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        cli.build_parser(environ)


def test_main_reports_a_bad_environment_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "many")
    assert cli.main(["serve"]) == 2
    assert "DEEPINFER_MAX_NUM_SEQS='many'" in capsys.readouterr().err


def test_server_py_is_deepinfer_serve() -> None:
    def run(*argv: str) -> str:
        proc = subprocess.run(
            [sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return proc.stdout

    assert run("server.py") == run("-m", "deepinfer.cli", "serve")


def test_pull_is_handed_the_rest_of_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("deepinfer.pull")
    fake.run_pull = lambda argv: seen.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepinfer.pull", fake)
    assert cli.main(["pull", "smollm2", "--model-dir", "/tmp/m"]) == 7
    assert seen == [["smollm2", "--model-dir", "/tmp/m"]]


def test_retention_classes_are_the_enum() -> None:
    assert [r.value for r in Retention] == ["agent", "chat", "none"]
    for retention in ("agent", "chat", "none", None):
        check_retention(retention)
    with pytest.raises(InvalidRequestError, match="agent, chat, none"):
        check_retention("forever")
    with pytest.raises(ConfigError, match="default_retention"):
        Config(disk_cache=dataclasses.replace(Config().disk_cache, default_retention="x"))  # type: ignore[arg-type]


def test_native_kernel_settings_are_read_through_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from deepinfer.kernels.native.cpu_native import native_dir

    monkeypatch.setenv("DEEPINFER_NATIVE_DIR", str(tmp_path))
    assert native_dir() == tmp_path
    monkeypatch.delenv("DEEPINFER_NATIVE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_dir() == tmp_path / "xdg" / "deepinfer" / "native"


# README and the user docs: every flag they name parses, with every value they show.

DOC_PAGES = [
    "README.md",
    *(f"docs/{p}.md" for p in ("usage", "features", "cpu", "operations", "api")),
]
DOCS = "\n".join((ROOT / page).read_text() for page in DOC_PAGES)
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
SPAN = re.compile(r"`([^`]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w<-])")  # not `--no-<flag>`


def _docs_spans() -> list[str]:
    """Code spans outside code blocks, split at `&&`, less pip's commands."""
    spans = [part for span in SPAN.findall(FENCE.sub("", DOCS)) for part in span.split("&&")]
    return [span for span in spans if "pip" not in span.split()]


def _docs_lines() -> list[str]:
    """Lines of code blocks (comments cut, split at `&&`) and of prose, less pip's commands."""
    code = [line.split("#")[0] for block in FENCE.findall(DOCS) for line in block.splitlines()]
    lines = [part.strip() for line in code for part in line.split("&&")]
    lines += SPAN.sub("", FENCE.sub("", DOCS)).splitlines()
    return [line for line in lines if "pip" not in line.split() and not _other_program(line)]


def _other_program(line: str) -> bool:
    """A command line of another program the docs show beside ours (a router in front)."""
    return line.split()[:1] == ["vllm-router"]


@functools.cache
def _pull_flags() -> frozenset[str]:
    """The flags `deepinfer pull --help` lists (pull has its own parser)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(["pull", "--help"])
    return frozenset(FLAG.findall(out.getvalue()))


def test_every_flag_in_the_docs_is_a_flag() -> None:
    known = set().union(*(_option_strings(p) for p in _subparsers().values()), _pull_flags())
    flags = {f for text in _docs_spans() + _docs_lines() for f in FLAG.findall(text)}
    assert len(flags) > 30 and flags <= known, sorted(flags - known)


def _docs_flag_values() -> list[tuple[str, str]]:
    """(flag, value) for each value the docs show after a flag in a code span (`a|b` is two)."""
    cases = []
    for span in _docs_spans():
        words = span.split()
        for flag, value in zip(words, [*words[1:], ""], strict=True):
            if flag.startswith("--") and value and not value.startswith("--"):
                cases += [(flag, v if not v.isupper() else "/tmp/x") for v in value.split("|")]
    return cases


@pytest.mark.parametrize(("flag", "value"), _docs_flag_values())
def test_every_value_the_docs_show_parses(flag: str, value: str) -> None:
    command = next(c for c, p in _subparsers().items() if flag in _option_strings(p))
    head = [command, "a prompt"] if command == "generate" else [command]
    config_from_args(_parse([*head, flag, value]))


def _docs_commands() -> list[list[str]]:
    """The docs' `deepinfer ...` and `python3 server.py ...` commands, as `deepinfer` argv."""
    commands = []
    for line in _docs_lines():
        words = shlex.split(line) if line.startswith(("deepinfer ", "python")) else []
        if words[:1] == ["deepinfer"]:
            commands.append(words[1:])
        elif words[1:2] == ["server.py"]:
            commands.append(["serve", *words[2:]])
    return commands


@pytest.mark.parametrize("argv", _docs_commands(), ids=" ".join)
def test_every_command_in_the_docs_parses(argv: list[str]) -> None:
    if argv[0] == "pull":
        assert set(FLAG.findall(" ".join(argv))) <= _pull_flags()
    else:
        config_from_args(_parse(argv))


def test_every_variable_the_docs_name_is_read() -> None:
    names = set(re.findall(r"DEEPINFER_[A-Z][A-Z0-9_]*(?![\w<])", DOCS))
    flag_envs = {name for _, environ, _ in _env_cases() for name in environ}
    sources = "".join(
        p.read_text() for p in [*ROOT.glob("deepinfer/**/*.py"), *ROOT.glob("kernels/**/*.py")]
    )
    for name in names - flag_envs:
        lower = name.removeprefix("DEEPINFER_").lower()
        assert f'env_value("{lower}")' in sources or f'"{name}"' in sources, name
    assert "DEEPINFER_MODEL" in names


def test_bf16_prefill_is_refused_in_batch_invariant_mode() -> None:
    """Which rows take the bf16 tiles depends on the chunk: not with `--batch-invariant`."""
    assert _config([]).model.bf16_prefill == "auto"
    assert _config(["--bf16-prefill", "off", "--batch-invariant"]).model.batch_invariant
    with pytest.raises(ConfigError, match="bf16_prefill on"):
        _config(["--bf16-prefill", "on", "--batch-invariant"])
