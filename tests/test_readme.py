"""The README's usage example runs as written (GPU tier) and matches the float64 reference."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def usage_example() -> str:
    text = README.read_text()
    section = text[text.index("## Usage"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_usage_example_is_python():
    compile(usage_example(), "README usage", "exec")


@pytest.mark.gpu
def test_usage_example_runs_and_is_right():
    from rtattn.plan.reference import reference_attention
    scope: dict = {}
    exec(compile(usage_example(), "README usage", "exec"), scope)
    torch = scope["torch"]
    torch.cuda.synchronize()
    f64 = lambda t: t.float().cpu().numpy().astype(np.float64)  # noqa: E731
    used = int(scope["kv_indices"].max()) + 1     # only the pages the example reads
    want_o, want_lse = reference_attention(f64(scope["q"]), f64(scope["k_cache"][:used]), f64(scope["v_cache"][:used]),
                                           np.array([0, 1, 2], np.int32), scope["kv_indptr"], scope["kv_indices"],
                                           scope["kv_last_page_len"], scope["page"])
    got = f64(scope["out"])
    assert np.linalg.norm(got - want_o) / np.linalg.norm(want_o) < 2e-2
    assert np.abs(scope["lse"].cpu().numpy() - want_lse).max() < 2e-2
