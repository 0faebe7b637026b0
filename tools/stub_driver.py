"""Running a tools/ script against the stub libcuda (tools/stub_libcuda.c: every driver call
returns at once), so that what it times is the host path alone: build the stub, then run the
script again with it first on the library path (RTATTN_BENCH_HOST_STUB=1 marks the second run)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def active() -> bool:
    """Whether this process is the re-run under the stub."""
    return os.environ.get("RTATTN_BENCH_HOST_STUB") == "1"


def reexec_with_stub(script: str, argv) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rtattn-stub-"))
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(tmp / "libcuda.so.1"),
                    str(TOOLS / "stub_libcuda.c"), "-ldl"], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp), STUB_QUIET="1", RTATTN_BENCH_HOST_STUB="1")
    return subprocess.call([sys.executable, script] + list(argv), env=env)


class Patch:
    """monkeypatch.setattr for a script (tests/fakes.install takes any object with setattr)."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)
