"""A model `deepinfer pull` fetched is named wherever a path is: `--model NAME`,
`--draft-model NAME`, `null:NAME`, for `serve`, `generate` and `chat` alike (`resolve_model`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deepinfer import cli
from deepinfer.args import config_from_args
from deepinfer.environment import default_model_dir, resolve_model
from deepinfer.model.null_model import vocabulary_path
from deepinfer.model_dir import MANIFEST_FILE

GEMMA3 = default_model_dir() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser({}).parse_args(argv)


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model directory holding `tiny` as `deepinfer pull` lays it out."""
    root = tmp_path / "models"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "tiny.gguf").write_bytes(b"GGUF")
    (root / "tiny" / MANIFEST_FILE).write_text(
        '{"file": "tiny.gguf", "size_bytes": 4, "sha256": "", "packages": []}'
    )
    (root / "half").mkdir()  # a pull that never finished: no manifest
    monkeypatch.setenv("DEEPINFER_MODEL_DIR", str(root))
    monkeypatch.chdir(tmp_path)
    return root


def test_a_pulled_name_resolves_to_its_file(model_dir: Path) -> None:
    assert resolve_model(Path("tiny")) == model_dir / "tiny" / "tiny.gguf"
    for given in ("half", "unknown", "null", "some/tiny", "tiny.gguf"):
        assert resolve_model(Path(given)) == Path(given)


def test_a_path_that_exists_wins(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tiny").write_bytes(b"GGUF")  # a file named like the model, in the cwd
    assert resolve_model(Path("tiny")) == Path("tiny")


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["chat"]])
def test_every_command_takes_a_name(model_dir: Path, command: list[str]) -> None:
    flags = ["--model", "tiny", "--speculative", "draft-model", "--draft-model", "tiny"]
    config = config_from_args(_parse([*command, *flags]))
    assert config.model.resolved_path() == model_dir / "tiny" / "tiny.gguf"
    assert config.speculative.draft_model == "tiny"  # resolved where the draft is loaded
    assert resolve_model(Path(config.speculative.draft_model)) == config.model.resolved_path()


def test_a_null_model_takes_a_name_for_its_vocabulary(model_dir: Path) -> None:
    assert vocabulary_path(Path("null:tiny")) == model_dir / "tiny" / "tiny.gguf"


@pytest.mark.skipif(not GEMMA3.is_file(), reason="run `deepinfer pull gemma3-270m`")
def test_the_pulled_gemma3() -> None:
    config = config_from_args(_parse(["serve", "--model", "gemma3-270m"]))
    assert config.model.resolved_path() == GEMMA3
