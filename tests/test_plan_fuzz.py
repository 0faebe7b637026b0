"""Property test of the one validation path, through wrapper.plan on the fake GPU: random page
tables, mostly malformed (tests/plan_fuzz.py). Every invalid table gets a ValueError/TypeError
naming a broken array or bound; every valid one is accepted and passes verify_plan with the
table's own lengths and page ids. tools/fuzz_plan.py runs 100,000 of these cases."""
from __future__ import annotations

import numpy as np
import pytest

import plan_fuzz


@pytest.mark.parametrize("seed", [0, 1])
def test_random_page_tables_through_wrapper_plan(monkeypatch, seed):
    failures = []
    stats = plan_fuzz.fuzz(monkeypatch, 2500, seed=seed,
                           on_failure=lambda i, a, k, err: failures.append(f"case {i}: {err}"))
    assert failures == [], "\n".join(failures[:10])
    assert stats["valid"] > 500 and stats["invalid"] > 1000   # both sides really exercised


def test_oracle_agrees_with_the_documented_rules():
    cfg = plan_fuzz.CONFIGS[0]   # page 16, pool 80
    ok = [np.array([0, 2, 3], np.int32), np.array([5, 79, 0], np.int32), np.array([16, 1], np.int32)]
    assert plan_fuzz.judge(cfg, ok, {}) == ([1, 1], [32, 1], 3)
    for i, bad in [(0, [0, 2**31 - 1, -2**31 + 1]), (1, [5, 80, 0]), (2, [16, 17]), (2, [0.5, 1.0])]:
        args = list(ok)
        args[i] = np.asarray(bad)
        with pytest.raises(plan_fuzz.Invalid):
            plan_fuzz.judge(cfg, args, {})
