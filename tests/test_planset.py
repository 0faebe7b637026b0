"""Plan sets: several plans and arrays at fixed, aligned, disjoint offsets in one buffer."""
from __future__ import annotations

import numpy as np
import pytest

from rtattn.plan.fields import ALIGN, PlanBounds, PlanLayout
from rtattn.plan.planset import PlanSet


def test_parts_are_aligned_disjoint_and_views_alias_the_buffer():
    a = PlanLayout(PlanBounds(8, 8, 64, 4, 1))
    b = PlanLayout(PlanBounds(4, 64, 32, 4, 16, page_size=16))
    ps = PlanSet({"decode": a, "prefill": b, "rows": 1000, "info": 4})
    spans = [(o, o + n) for _, o, n in ps.table()]
    assert all(o % ALIGN == 0 for o, _ in spans) and spans[-1][1] == ps.plan_bytes
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    buf = ps.allocate()
    v = ps.views(buf)
    v["decode"]["work_indptr"][:] = 1
    v["prefill"]["work_indptr"][:] = 2
    v["rows"][:] = 3
    assert (buf.view(np.int32)[ps.offsets["rows"] // 4:][:1000] == 3).all()
    assert (v["decode"]["work_indptr"] == 1).all() and v["rows"].shape == (1000,)
    ptrs = ps.device_ptrs(1 << 20)
    assert ptrs["rows"] == (1 << 20) + ps.offsets["rows"]
    assert ptrs["prefill"]["work_indptr"] == (1 << 20) + ps.offsets["prefill"] + b.offsets["work_indptr"]


def test_a_short_buffer_is_refused():
    ps = PlanSet({"rows": 10})
    with pytest.raises(ValueError, match="plan set needs"):
        ps.views(np.zeros(8, np.uint8))
