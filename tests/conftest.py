"""Shared test setup: GPU-tier auto-skip, an isolated CUBIN cache, and making
sure the tests exercise the *installed* rtattn."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent


def _installed_rtattn() -> Path | None:
    """rtattn/__init__.py of a non-editable install outside this checkout (an editable install
    lists no such file; the checkout's own egg-info points into the checkout)."""
    from importlib import metadata
    for dist in metadata.distributions(name="rtattn"):
        for f in dist.files or ():
            if str(f).replace("\\", "/") == "rtattn/__init__.py":
                path = Path(f.locate()).resolve()
                if path.is_file() and path != _ROOT / "rtattn" / "__init__.py":
                    return path
    return None


def _prefer_installed_rtattn() -> None:
    # `python -m pytest` puts the repo root first on sys.path, so `import rtattn` would find the
    # checkout's rtattn/ (which works: rtattn/__init__.py maps codegen/, graphs/, cuda_src/ in).
    # CI installs rtattn non-editable to test the packaging: then test the installed package.
    installed = _installed_rtattn()
    if installed is None:
        return
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
    # Child interpreters (`python -c ...` in tests) would import the checkout too.
    os.environ["PYTHONSAFEPATH"] = "1"
    for name in [m for m in sys.modules if m == "rtattn" or m.startswith("rtattn.")]:
        del sys.modules[name]
    import rtattn  # noqa: F401
    assert Path(rtattn.__file__).resolve() == installed, rtattn.__file__


_prefer_installed_rtattn()

from rtattn.runtime import driver  # noqa: E402


def pytest_report_header(config):
    import rtattn
    from rtattn.runtime import nvrtc
    dev = "none: " + driver.no_device_reason()
    if driver.has_device():
        d = driver.Device(0)
        dev = f"{d.name} ({d.arch}), {driver.device_count()} device(s)"
    return [f"rtattn: {Path(rtattn.__file__).parent}", f"GPU: {dev}",
            f"NVRTC: {'.'.join(map(str, nvrtc.nvrtc_version()))}"]


def pytest_collection_modifyitems(config, items):
    if driver.has_device():
        return
    skip = pytest.mark.skip(reason=f"no CUDA device ({driver.no_device_reason()})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A fresh, empty CUBIN cache (disk and memo) and zeroed counters."""
    from rtattn.runtime import cubin_cache
    monkeypatch.setenv("RTATTN_CACHE_DIR", str(tmp_path / "cache"))
    cubin_cache.clear_memo()
    cubin_cache.cache_stats(reset=True)
    yield tmp_path / "cache"
    cubin_cache.clear_memo()


@pytest.fixture
def device():
    return driver.Device(0)
