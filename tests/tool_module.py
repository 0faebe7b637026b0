"""A tools/ script imported by the tests that check it (tools/ is no package): loaded afresh from
its file, with tools/ on sys.path for its own imports (bench_common) and the module in
sys.modules under its name (its dataclasses, and demo_tp's rank processes, look it up there)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load(name: str):
    """tools/NAME.py as the module NAME."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
