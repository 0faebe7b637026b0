"""SharedPlan: one host plan, one copy per device. CPU tier on the fake driver of
tests/fake_driver.py (three fake devices); GPU tier: wrappers sharing a plan give bitwise the
outputs of wrappers planning alone (on one GPU: two wrappers on device 0)."""
from __future__ import annotations

import numpy as np
import pytest

from fake_driver import drv  # noqa: F401 (the fixture: three fake devices)
import rtattn
from rtattn.plan.layout import paged_kv
from rtattn.runtime import DeviceBuffer, Stream, driver

H_QO, H_KV, D, PS = 8, 2, 64, 16




def _wrapper(device, **kw):
    args = dict(max_batch=8, max_pages=64, device=device)
    args.update(kw)
    return rtattn.BatchDecodeWrapper(H_QO, H_KV, D, PS, **args)


def _cache(device, pages=40):
    return DeviceBuffer(pages * PS * H_KV * D * 2, device).as_tensor("bfloat16", (pages, PS, H_KV, D))


def _workspace_plan(drv, w) -> np.ndarray:
    return drv.memory[w.workspace.ptr][1][:w.layout.plan_bytes].copy()


def test_one_host_plan_is_copied_once_to_every_device(drv):
    ws = [_wrapper(d) for d in range(3)]
    streams = [Stream(device=d) for d in range(3)]
    plans = rtattn.SharedPlan(ws)
    kvp, idx, last = paged_kv([100, 20, 300, 7], PS, shuffle_seed=1)
    before = len(drv.copies)
    info = plans.plan(kvp, idx, last, streams=streams)
    copies = drv.copies[before:]
    assert [(c[0], c[1], c[3], c[4]) for c in copies] == [(d, ws[d].workspace_ptr, ws[d].layout.plan_bytes,
                                                          streams[d].handle) for d in range(3)]
    assert len({c[2] for c in copies}) == 1                  # one pinned source for every device
    alone = _wrapper(0)
    alone.plan(kvp, idx, last)
    want = _workspace_plan(drv, alone)
    assert all((_workspace_plan(drv, w) == want).all() for w in ws)   # the plan each would have made
    assert all(w.info is info for w in ws) and drv.errors == []


def test_each_wrapper_runs_the_shared_plan_on_its_device(drv):
    ws = [_wrapper(d) for d in range(2)]
    streams = [Stream(device=d) for d in range(2)]
    plans = rtattn.SharedPlan(ws)
    driver.set_current_context(ws[0].device.context_handle)
    for step, lens in enumerate(([50, 60], [10, 20, 30], [200, 1, 1, 9])):
        plans.plan(*paged_kv(lens, PS, shuffle_seed=step), streams=streams)
        for d, w in enumerate(ws):
            q = DeviceBuffer(len(lens) * H_QO * D * 2, d).as_tensor("bfloat16", (len(lens), H_QO, D))
            out = w.run(q, _cache(d), _cache(d), stream=streams[d])
            assert out.shape == (len(lens), H_QO, D) and out.device_id == d
    for d in range(2):   # three steps of each wrapper, every one on its device and stream
        assert {rec[3] for rec in drv.launches if rec[0] == d} == {streams[d].handle}
        assert len({rec[4] for rec in drv.launches if rec[0] == d}) >= 1
    assert sum(rec[1] == ws[0].kernels.rendered.decode_name for rec in drv.launches) == 6
    assert driver.get_current_context() == ws[0].device.context_handle and drv.errors == []


def test_the_pinned_buffers_are_used_in_turn_and_wait_for_every_devices_copy(drv):
    ws = [_wrapper(d) for d in range(2)]
    plans = rtattn.SharedPlan(ws)
    lens = paged_kv([30, 40], PS, shuffle_seed=0)
    sources = []
    for _ in range(3):
        n = len(drv.calls)
        plans.plan(*lens)
        sources.append(drv.copies[-1][2])
        waits = [c for c, _ in drv.calls[n:] if c == "cuEventSynchronize"]
    assert sources[0] == sources[2] != sources[1]
    assert len(waits) == 2                                   # the third plan waited for both copies of the first


def test_the_smallest_kv_pool_of_the_wrappers_bounds_page_ids(drv):
    ws = [_wrapper(0, num_pages_pool=60), _wrapper(1, num_pages_pool=40)]
    plans = rtattn.SharedPlan(ws)
    kvp, idx, last = paged_kv([100, 20], PS, shuffle_seed=1)
    bad = idx.copy()
    bad[0] = 45
    before = len(drv.copies)
    with pytest.raises(ValueError, match=r"kv_indices\[0\] = 45 is outside the page pool \[0, 40\)"):
        plans.plan(kvp, bad, last)
    assert len(drv.copies) == before and ws[0].planner.num_pages_pool == 60


def test_wrappers_that_would_plan_differently_are_refused(drv):
    with pytest.raises(ValueError, match=r"wrappers\[1\] plans differently .*planner bounds"):
        rtattn.SharedPlan([_wrapper(0), _wrapper(1, max_batch=16)])
    with pytest.raises(ValueError, match=r"wrappers\[2\] plans differently .*planner bounds"):
        rtattn.SharedPlan([_wrapper(0), _wrapper(1), _wrapper(2, num_ctas=7)])
    with pytest.raises(ValueError, match=r"wrappers: SharedPlan needs at least one"):
        rtattn.SharedPlan([])
    plans = rtattn.SharedPlan([_wrapper(0), _wrapper(1)])
    with pytest.raises(ValueError, match=r"streams: 1 given for 2 wrappers"):
        plans.plan(*paged_kv([3], PS), streams=[None])
    with pytest.raises(ValueError, match=r"stream 0x[0-9a-f]+ belongs to cuda:0, but this launch runs on cuda:1"):
        plans.plan(*paged_kv([3], PS), streams=[None, Stream(device=0)])
    assert plans.info is None


# ---------------------------------------------------------------------------- GPU tier
@pytest.mark.gpu
def test_gpu_a_shared_plan_gives_bitwise_the_outputs_of_plans_made_alone():
    """A wrapper per visible device (on one GPU: two wrappers of device 0, a simulated split):
    after a shared plan, each run() is bitwise the run() of a wrapper that planned alone."""
    n = driver.device_count()
    devices = list(range(n)) if n > 1 else [0, 0]
    rng = np.random.default_rng(5)
    ws = [_wrapper(d, dtype="float16") for d in devices]
    alone = [_wrapper(d, dtype="float16") for d in devices]
    plans = rtattn.SharedPlan(ws)
    pages = 40

    def dev_array(a, d):
        buf = DeviceBuffer(a.nbytes, d)
        buf.copy_from_host(a)
        return buf.as_tensor("float16", a.shape)
    for step in range(3):
        lens = rng.integers(1, 81, size=int(rng.integers(1, 8)))   # <= 35 pages of the 40
        kvp, idx, last = paged_kv(lens, PS, shuffle_seed=step)
        plans.plan(kvp, idx, last)
        q = rng.standard_normal((len(lens), H_QO, D)).astype(np.float16)
        k, v = (rng.standard_normal((pages, PS, H_KV, D)).astype(np.float16) for _ in range(2))
        for d, w, w1 in zip(devices, ws, alone):
            w1.plan(kvp, idx, last)
            qt, kt, vt = (dev_array(a, d) for a in (q, k, v))
            got, want = w.run(qt, kt, vt), w1.run(qt, kt, vt)
            w.device.synchronize()
            host = [t.owner.copy_to_host(np.empty(q.shape, np.float16)) for t in (got, want)]
            assert np.isfinite(host[0]).all() and host[0].tobytes() == host[1].tobytes()


def test_prefill_wrappers_share_a_plan_and_ragged_ones_are_refused(drv):
    ws = [rtattn.BatchPrefillWrapper(H_QO, H_KV, D, PS, max_batch=4, max_qo_tokens=256, max_pages=64, device=d)
          for d in (1, 2)]
    plans = rtattn.SharedPlan(ws)
    kvp, idx, last = paged_kv([100, 300], PS, shuffle_seed=2)
    with pytest.raises(ValueError, match=r"^qo_indptr: a prefill wrapper's plan needs the query offsets"):
        plans.plan(kvp, idx, last)
    info = plans.plan(kvp, idx, last, qo_indptr=np.array([0, 30, 94], np.int32))
    assert info.num_qo_tokens == 94 and all(w.info is info for w in ws)
    assert [c[0] for c in drv.copies[-2:]] == [1, 2] and drv.errors == []
    ragged = rtattn.BatchPrefillWrapper(H_QO, H_KV, D, kv_layout="ragged", max_batch=4, max_qo_tokens=256,
                                        max_kv_tokens=1024, device=0)
    with pytest.raises(TypeError, match=r"wrappers\[1\]: SharedPlan takes paged"):
        rtattn.SharedPlan([ws[0], ragged])
