"""`deepinfer pull`: wheels fetched without installing, joined atomically, verified, idempotent.

Most tests pull from wheels built here (through pip with `--no-index --find-links`, or a
downloader that copies them); one slow test pulls the real default model from the index.
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from deepinfer.environment import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_NAME,
    default_model_dir,
    default_model_path,
)
from deepinfer.errors import ConfigError
from deepinfer.model_dir import MANIFEST_FILE, DownloadError, PullError, read_manifest
from deepinfer.pull import (
    CATALOG,
    ModelSource,
    PipDownloader,
    WheelPart,
    find_wheel,
    pull,
    run_pull,
)

CONTENT = b"GGUF" + random.Random(0).randbytes(300_000)
"""A fake model file: the GGUF magic, then bytes that make every piece distinct."""


def _source(content: bytes = CONTENT, num_parts: int = 2, sha256: str | None = None) -> ModelSource:
    """The default model's name and file, joined from `num_parts` fake packages."""
    parts = tuple(
        WheelPart(f"fake-model-part{i}", "1.0.0", f"fake_model_part{i}/data/model.part{i}")
        for i in range(num_parts)
    )
    digest = sha256 or hashlib.sha256(content).hexdigest()
    return ModelSource(DEFAULT_MODEL_NAME, DEFAULT_MODEL_FILE, parts, len(content), digest)


def _write_wheel(directory: Path, part: WheelPart, data: bytes | None) -> Path:
    """A minimal wheel of `part` holding `data` (stored, uncompressed) at its member."""
    dist = re.sub(r"[-_.]+", "_", part.package)
    info = f"{dist}-{part.version}.dist-info"
    path = directory / f"{dist}-{part.version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {part.package}\nVersion: {part.version}\n"
    wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        if data is not None:
            z.writestr(part.member, data)
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", wheel)
        z.writestr(f"{info}/RECORD", "")
    return path


def _write_wheels(directory: Path, source: ModelSource, content: bytes = CONTENT) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cuts = [len(content) * i // len(source.parts) for i in range(len(source.parts) + 1)]
    for part, start, end in zip(source.parts, cuts, cuts[1:], strict=False):
        _write_wheel(directory, part, content[start:end])
    return directory


class CopyDownloader:
    """Copies prebuilt wheels (no pip, no network) and counts calls; `fail` raises instead."""

    def __init__(self, wheels: Path, fail: BaseException | None = None) -> None:
        self.wheels, self.fail, self.calls = wheels, fail, 0

    def __call__(self, parts: Sequence[WheelPart], dest: Path) -> list[Path]:
        self.calls += 1
        out = []
        for part in parts:
            out.append(Path(shutil.copy(find_wheel(self.wheels, part), dest)))
            if self.fail is not None:
                raise self.fail
        return out


def _picked() -> Path | None:
    try:
        return default_model_path()
    except ConfigError:
        return None


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh model directory that `default_model_path` looks in."""
    path = tmp_path / "models"
    monkeypatch.setenv("DEEPINFER_MODEL_DIR", str(path))
    return path


def test_pull_through_pip_joins_the_pieces_in_order(tmp_path: Path, model_dir: Path) -> None:
    source = _source(num_parts=3)
    index = _write_wheels(tmp_path / "index", source)
    download = PipDownloader(extra_args=("--no-index", "--find-links", str(index)))
    result = pull(source, model_dir, download)
    assert result.fetched and result.path == model_dir / DEFAULT_MODEL_NAME / DEFAULT_MODEL_FILE
    assert result.path.read_bytes() == CONTENT
    manifest = read_manifest(result.path.parent)
    assert manifest is not None and manifest.sha256 == hashlib.sha256(CONTENT).hexdigest()
    assert manifest.packages == [p.requirement for p in source.parts]
    assert sorted(p.name for p in result.path.parent.iterdir()) == sorted(
        [".lock", MANIFEST_FILE, DEFAULT_MODEL_FILE]
    )
    assert default_model_path() == result.path


def test_pip_failure_is_a_download_error(tmp_path: Path) -> None:
    source = _source()
    download = PipDownloader(extra_args=("--no-index", "--find-links", str(tmp_path)))
    with pytest.raises(DownloadError, match=re.escape("fake-model-part0==1.0.0")):
        pull(source, tmp_path / "models", download)
    assert not (tmp_path / "models" / source.name / source.file).exists()


def test_second_pull_is_a_noop_without_network(tmp_path: Path, model_dir: Path) -> None:
    source = _source()
    first = pull(source, model_dir, CopyDownloader(_write_wheels(tmp_path / "w", source)))
    before = first.path.stat()
    offline = CopyDownloader(tmp_path / "w", fail=DownloadError("no network"))
    second = pull(source, model_dir, offline)
    assert first.fetched and not second.fetched and offline.calls == 0
    after = second.path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_a_damaged_model_is_fetched_again(tmp_path: Path, model_dir: Path, damage: str) -> None:
    source = _source()
    download = CopyDownloader(_write_wheels(tmp_path / "w", source))
    path = pull(source, model_dir, download).path
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-1]))
    else:
        (path.parent / MANIFEST_FILE).write_text("{not json")
    again = pull(source, model_dir, download)
    assert again.fetched and download.calls == 2
    assert path.read_bytes() == CONTENT


def _corrupt_stored_member(wheel: Path, content: bytes) -> None:
    """Flip a byte near the end of a stored member: reading it fails on its CRC, after most
    of it has already been written out."""
    data = bytearray(wheel.read_bytes())
    data[data.index(content[-64:]) + 32] ^= 0xFF
    wheel.write_bytes(bytes(data))


@pytest.mark.parametrize("interrupt", ["crc", "keyboard"])
def test_an_interrupted_pull_leaves_nothing_to_pick(
    tmp_path: Path, model_dir: Path, interrupt: str
) -> None:
    source = _source(num_parts=1)
    wheels = _write_wheels(tmp_path / "w", source)
    target = model_dir / source.name / source.file
    if interrupt == "crc":
        _corrupt_stored_member(find_wheel(wheels, source.parts[0]), CONTENT)
        with pytest.raises(PullError, match="CRC"):
            pull(source, model_dir, CopyDownloader(wheels))
    else:
        with pytest.raises(KeyboardInterrupt):
            pull(source, model_dir, CopyDownloader(wheels, fail=KeyboardInterrupt()))
    assert not target.exists() and _picked() != target
    assert [p.name for p in target.parent.iterdir()] == [".lock"]


def test_a_killed_pulls_leftovers_are_ignored_then_removed(tmp_path: Path, model_dir: Path) -> None:
    source = _source()
    directory = model_dir / source.name
    (directory / ".pull-killed").mkdir(parents=True)
    (directory / ".pull-killed" / "x.whl").write_bytes(b"partial")
    (directory / ".pull-killed.partial").write_bytes(CONTENT[:1000])
    assert _picked() != directory / source.file
    pull(source, model_dir, CopyDownloader(_write_wheels(tmp_path / "w", source)))
    assert not list(directory.glob(".pull-*"))


@pytest.mark.parametrize(
    ("content", "sha256", "message"),
    [
        (CONTENT, "0" * 64, "sha256"),
        (b"NOPE" + CONTENT[4:], None, "GGUF magic"),
    ],
    ids=["wrong-sha256", "no-magic"],
)
def test_a_file_that_fails_verification_is_refused(
    tmp_path: Path, model_dir: Path, content: bytes, sha256: str | None, message: str
) -> None:
    source = _source(content, sha256=sha256)
    with pytest.raises(PullError, match=message):
        pull(source, model_dir, CopyDownloader(_write_wheels(tmp_path / "w", source, content)))
    assert not (model_dir / source.name / source.file).exists()


def test_wheels_that_do_not_add_up_are_refused_before_writing(
    tmp_path: Path, model_dir: Path
) -> None:
    source = _source()
    wheels = _write_wheels(tmp_path / "w", source, CONTENT + b"extra")
    with pytest.raises(PullError, match="expected 300004"):
        pull(source, model_dir, CopyDownloader(wheels))
    _write_wheel(wheels, source.parts[1], None)
    with pytest.raises(PullError, match="no readable"):
        pull(source, model_dir, CopyDownloader(wheels))


def test_concurrent_pulls_download_once(tmp_path: Path, model_dir: Path) -> None:
    source = _source()
    started = threading.Event()
    copy = CopyDownloader(_write_wheels(tmp_path / "w", source))

    def slow(parts: Sequence[WheelPart], dest: Path) -> list[Path]:
        started.set()
        time.sleep(0.2)  # let the other pull reach the lock while this one holds it
        return copy(parts, dest)

    results = []
    first = threading.Thread(target=lambda: results.append(pull(source, model_dir, slow)))
    first.start()
    started.wait(timeout=10)
    results.append(pull(source, model_dir, slow))
    first.join(timeout=10)
    assert copy.calls == 1 and sorted(r.fetched for r in results) == [False, True]


def test_default_model_dir_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DEEPINFER_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir() == tmp_path / "xdg" / "deepinfer" / "models"
    monkeypatch.setenv("DEEPINFER_MODEL_DIR", str(tmp_path / "own"))
    assert default_model_dir() == tmp_path / "own"


def test_unknown_name_lists_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_pull(["no-such-model", "--model-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and all(name in err for name in CATALOG)
    assert not list(tmp_path.iterdir())


def test_run_pull_reports_an_intact_model_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _source()
    pull(source, tmp_path, CopyDownloader(_write_wheels(tmp_path / "w", source)))
    monkeypatch.setitem(CATALOG, DEFAULT_MODEL_NAME, source)
    assert run_pull(["--model-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(tmp_path / source.name / source.file)
    assert "already there" in out.err


def test_module_entry_point(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "deepinfer.pull", "no-such-model", "--model-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "known models" in proc.stderr


@pytest.mark.slow
def test_pull_the_default_model_from_the_index(tmp_path: Path) -> None:
    import gguf

    source = CATALOG[DEFAULT_MODEL_NAME]
    try:
        result = pull(source, tmp_path)
    except DownloadError as exc:
        pytest.skip(f"pip cannot reach the package index: {exc}")
    assert result.fetched and not pull(source, tmp_path).fetched
    reader = gguf.GGUFReader(result.path)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    assert len(reader.tensors) == 272  # 30 layers x 9, token_embd, output_norm
