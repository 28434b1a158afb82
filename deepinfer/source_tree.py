"""Run from a source checkout: `deepinfer.kernels` is the checkout's own top-level kernels/.

kernels/ lives at the top of the repository and is installed as `deepinfer.kernels` by the
package-dir mapping in pyproject.toml: a wheel copies it into deepinfer/. It is a namespace package
(no `__init__.py`), so that with the repository root on sys.path (`python -m pytest`,
`PYTHONPATH=.`) an installed distribution named `kernels` (the Hub's, which transformers imports)
still wins over the folder. setuptools' editable hook finds a mapped package only by its
`__init__.py`, and where the root comes first on sys.path `deepinfer` is imported straight from
./deepinfer, which holds no kernels/. This finder, placed first on sys.meta_path only when
`deepinfer` was imported from a checkout (pyproject.toml and kernels/ beside it, no
deepinfer/kernels inside), maps that one name to the checkout's kernels/ as a namespace package;
its submodules follow from the package's `__path__`. In an installed wheel it is never placed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent
KERNELS_DIR = PACKAGE_DIR.parent / "kernels"
MARKER = "dispatch.py"
"""The module every kernel family imports: a kernels/ folder without it is not ours."""


class SourceKernelsFinder(MetaPathFinder):
    """Finds `deepinfer.kernels` in the checkout's kernels/, and nothing else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "deepinfer.kernels":
            return None
        spec = ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [str(KERNELS_DIR)]
        return spec


def is_checkout() -> bool:
    """Whether `deepinfer` was imported from a source checkout rather than an installed wheel."""
    return (
        (PACKAGE_DIR.parent / "pyproject.toml").is_file()
        and (KERNELS_DIR / MARKER).is_file()
        and not (PACKAGE_DIR / "kernels").exists()
    )


def install() -> None:
    """Place the finder first on sys.meta_path, once, when running from a checkout."""
    if is_checkout() and not any(isinstance(f, SourceKernelsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceKernelsFinder())
