"""merge_state / merge_states against the float64 merge operator of the plan executor."""
from __future__ import annotations

import numpy as np
import pytest

from rtattn import merge
from rtattn.plan.executor import merge_states as merge_ref


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_merge_states_source_compiles(arch, isolated_cache):
    from rtattn.runtime import compile_to_cubin
    assert compile_to_cubin(merge.source(), name="merge_states", arch=arch, quiet=True)[:4] == b"\x7fELF"


def _states(rng, rows, n, heads, d):
    v = rng.standard_normal((rows, n, heads, d))
    s = rng.standard_normal((rows, n, heads)) * 4
    s[0, :, 0] = -np.inf                      # a row with only empty states
    if n > 1:
        s[1, 0, :] = -np.inf                  # one empty state among others
    return v, s


def _oracle(v, s):
    o, l = v[:, 0], s[:, 0]
    for i in range(1, v.shape[1]):
        o, l = merge_ref(o, l, v[:, i], s[:, i])
    return np.where(np.isneginf(l)[..., None], 0.0, o), l


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_merge_states_matches_the_operator(dtype, n):
    import torch
    rng = np.random.default_rng(n)
    v, s = _states(rng, 37, n, 8, 128)
    tv = torch.tensor(v, dtype=getattr(torch, dtype), device="cuda")
    ts = torch.tensor(s, dtype=torch.float32, device="cuda")
    out, s_out = merge.merge_states(tv, ts)
    got = torch.from_dlpack(out).float().cpu().numpy()
    got_s = torch.from_dlpack(s_out).cpu().numpy()
    want, want_s = _oracle(tv.double().cpu().numpy(), ts.double().cpu().numpy())
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    fin = np.isfinite(want_s)
    assert np.array_equal(np.isneginf(got_s), ~fin) and np.abs(got_s[fin] - want_s[fin]).max() < 1e-4


@pytest.mark.gpu
def test_merge_state_two_separate_tensors():
    import torch
    rng = np.random.default_rng(7)
    v, s = _states(rng, 20, 2, 4, 64)
    va, vb = (torch.tensor(v[:, i], dtype=torch.float32, device="cuda") for i in range(2))
    sa, sb = (torch.tensor(s[:, i], dtype=torch.float32, device="cuda") for i in range(2))
    out, s_out = merge.merge_state(va, sa, vb, sb)
    want, want_s = _oracle(v, s)
    assert np.allclose(torch.from_dlpack(out).cpu().numpy(), want, atol=1e-5)
    with pytest.raises(TypeError, match="float16"):
        merge.merge_state(va, sa, vb.half(), sb)
