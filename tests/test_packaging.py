"""Packaging: `import rtattn` from the repository root works however rtattn is installed (the
checkout's rtattn/ finds the package-dir-mapped subpackages in their top-level folders)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import rtattn

ROOT = Path(__file__).resolve().parent.parent

# A fresh interpreter with the root first on sys.path and no editable-install finder: what a
# non-editable install sees when run from the checkout.
PROBE = r"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, ROOT)
import rtattn, rtattn.codegen.spec, rtattn.graphs.step_graph, rtattn.cuda_src
from rtattn.runtime import cuda_src_dir
from pathlib import Path
assert Path(rtattn.__file__).parent == Path(ROOT) / "rtattn", rtattn.__file__
assert Path(rtattn.graphs.__file__).parent == Path(ROOT) / "graphs", rtattn.graphs.__file__
assert (cuda_src_dir() / "decode.cuh").is_file(), cuda_src_dir()
print("ok")
"""


def test_import_from_the_repository_root_without_an_editable_finder():
    p = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + PROBE], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_mapped_subpackages_match_pyproject():
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {k: v for k, v in cfg.items() if k != v} == rtattn.MAPPED_SUBPACKAGES


def test_every_rtattn_subpackage_is_listed_in_pyproject():
    """A subpackage missing from `packages` imports from the checkout but not once installed."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"rtattn." + ".".join(p.parent.relative_to(ROOT / "rtattn").parts)
             for p in (ROOT / "rtattn").rglob("__init__.py") if p.parent != ROOT / "rtattn"}
    assert found <= listed, sorted(found - listed)
