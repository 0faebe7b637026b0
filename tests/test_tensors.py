"""rtattn.tensors.TensorImports on the CPU: imports remembered per object, re-imported when the
object's memory changes, forgotten when it dies, and the stream order a skipped DLPack handshake
would have given. A stand-in 'torch.Tensor' class plays the framework."""
from __future__ import annotations

import gc
import sys
from types import SimpleNamespace

import pytest

import rtattn.runtime as R
from rtattn.runtime import export
from rtattn.tensors import TensorImports


class Tensor:
    """Looks like torch.Tensor to TensorImports (module 'torch', class 'Tensor'); exports a view."""
    __module__ = "torch"

    def __init__(self, ptr, shape, dtype="bfloat16"):
        self.set_(ptr, shape, dtype)
        self.exports = 0

    def set_(self, ptr, shape, dtype="bfloat16"):
        self.view = export(ptr, shape, dtype, 0)
        self.dtype = dtype

    def data_ptr(self):
        return self.view.ptr

    @property
    def shape(self):
        return self.view.shape

    def stride(self):
        return self.view.strides

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, max_version=None):
        self.exports += 1
        return self.view.__dlpack__(stream=None, max_version=max_version)


@pytest.fixture
def fake_torch(monkeypatch):
    """sys.modules['torch'] with a current stream, and an Event that records what order() does."""
    state = SimpleNamespace(current=0, events=[], waits=[])
    torch = SimpleNamespace(_C=SimpleNamespace(_cuda_getCurrentRawStream=lambda dev: state.current))
    monkeypatch.setitem(sys.modules, "torch", torch)

    class Event:
        def __init__(self, timing=True, device=None):
            pass

        def link(self, producer, consumer):   # recorded on producer, waited for by consumer
            state.events.append(producer)
            state.waits.append(consumer)
    monkeypatch.setattr(R, "Event", Event)
    return state


def _rows(name, view):
    return (view.ptr, view.shape, view.strides)


def test_a_tensor_seen_before_is_not_imported_again(fake_torch):
    imp = TensorImports()
    t = Tensor(1 << 30, (4, 32, 128))
    a = imp.get("q", t, 0, _rows)
    b = imp.get("q", t, 0, _rows)
    assert a == b == (1 << 30, (4, 32, 128), (32 * 128, 128, 1))
    assert t.exports == 1 and (imp.imports, imp.reuses) == (1, 1)
    derived = []
    imp.get("out", t, 0, lambda n, v: derived.append(n) or v.ptr)   # a new role derives from the same import
    imp.get("out", t, 0, lambda n, v: derived.append(n) or v.ptr)
    assert derived == ["out"] and t.exports == 1


@pytest.mark.parametrize("change", [
    lambda t: t.set_((1 << 30) + 4096, (4, 32, 128)),        # storage swapped (torch set_ / .data =)
    lambda t: t.set_(1 << 30, (8, 32, 128)),                 # resized in place
    lambda t: t.set_(1 << 30, (4, 32, 128), "float16"),      # dtype changed under the object
])
def test_a_changed_tensor_is_imported_again(fake_torch, change):
    imp = TensorImports()
    t = Tensor(1 << 30, (4, 32, 128))
    before = imp.get("q", t, 0, lambda n, v: (v.ptr, v.shape, v.dtype))
    change(t)
    after = imp.get("q", t, 0, lambda n, v: (v.ptr, v.shape, v.dtype))
    assert t.exports == 2 and after != before and after == (t.view.ptr, t.view.shape, t.view.dtype)


def test_entries_go_with_their_objects_and_checks_are_not_remembered_on_failure(fake_torch):
    imp = TensorImports()
    t = Tensor(1 << 30, (4, 32, 128))
    imp.get("q", t, 0, _rows)
    assert len(imp) == 1
    del t
    gc.collect()
    assert len(imp) == 0
    bad = Tensor(1 << 30, (4, 32, 64))

    def check(name, v):
        if v.shape[-1] != 128:
            raise ValueError(f"{name} has shape {v.shape}")
        return v.ptr
    for _ in range(2):   # refused every time, never served from the cache
        with pytest.raises(ValueError, match="q has shape"):
            imp.get("q", bad, 0, check)
    views = [export(1 << 32, (2, 2), "float32") for _ in range(3)]   # rtattn views: weakly held too
    for v in views:
        imp.get("lse", v, 0, _rows)
    assert len(imp) == 3 and bad.exports == 2   # `bad` was refused, never remembered
    del views, v
    gc.collect()
    assert len(imp) == 0


def test_order_waits_for_the_framework_stream_only_when_it_differs(fake_torch):
    imp = TensorImports()
    t = Tensor(1 << 30, (4, 32, 128))
    imp.get("q", t, 0x5000, _rows)
    imp.order(0x5000)            # first import: the producer's own handshake ran, nothing to do
    assert fake_torch.events == []
    imp.get("q", t, 0x5000, _rows)
    fake_torch.current = 0x5000
    imp.order(0x5000)            # reused, but the framework enqueues on the same stream
    assert fake_torch.events == []
    imp.get("q", t, 0x5000, _rows)
    fake_torch.current = 0x7000
    imp.order(0x5000)            # reused from another stream: 0x5000 waits for 0x7000 once
    imp.order(0x5000)
    assert fake_torch.events == [0x7000] and fake_torch.waits == [0x5000]


# ----------------------------------------------------------------------------- GPU tier
@pytest.mark.gpu
def test_torch_tensors_reused_by_run_follow_set_and_the_producer_stream():
    """run() with the same torch tensors again: an output tensor re-pointed with set_() gets
    the result in its new storage (the old one untouched), and a q rewritten on torch's stream
    just before a run on another stream is read after the write (the skipped DLPack handshake
    is replaced by one stream wait)."""
    import dataclasses

    import torch
    from decode_cases import make_case, rel_error
    from rtattn.wrapper import BatchDecodeWrapper
    case = make_case([700, 33, 2000], 32, 8, 128, 16, seed=3)
    w = BatchDecodeWrapper(32, 8, 128, 16, max_batch=4, max_pages=int(case.kv_indptr[-1]) + 8)
    w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    want, _ = case.reference()
    out = torch.full_like(case.q, float("nan"))
    w.run(case.q, case.k_cache, case.v_cache, out=out)
    torch.cuda.synchronize()
    first = out.clone()
    assert rel_error(out.float().cpu().numpy(), want) < 2e-2
    old = out.view_as(out)                       # the first storage
    old.fill_(float("nan"))
    new = torch.full_like(case.q, float("nan"))
    out.set_(new)
    w.run(case.q, case.k_cache, case.v_cache, out=out)
    torch.cuda.synchronize()
    assert torch.equal(new.view(torch.int16), first.view(torch.int16)) and torch.isnan(old).all()
    assert w._imports.reuses >= 3

    q = case.q.clone()
    s = torch.cuda.Stream()
    w.run(q, case.k_cache, case.v_cache, out=out, stream=s)   # q imported (and remembered) on s
    s.synchronize()
    torch.cuda._sleep(200_000_000)               # torch's current stream busy for a while ...
    q.mul_(2)                                    # ... then rewrites q
    w.run(q, case.k_cache, case.v_cache, out=out, stream=s)
    s.synchronize()
    want2, _ = dataclasses.replace(case, q=case.q * 2).reference()
    assert rel_error(out.float().cpu().numpy(), want2) < 2e-2
