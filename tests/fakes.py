"""A fake GPU for CPU-tier tests of the wrapper and graph logic: device properties, buffers
with host-side bytes, kernels that record their launches, and one helper to install them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from rtattn import prefill_wrapper as PW
from rtattn import wrapper as W
from rtattn import wrapper_base as B
from rtattn.codegen.render import render_prefill
from rtattn.families.decode import render
from rtattn.runtime import export
from rtattn.runtime import launch as launch_mod
from rtattn.runtime import libcuda
from rtattn.kernels import LoadedKernels


def fake_device(name="fake H200"):
    props = SimpleNamespace(name=name, sm_count=132, smem_per_sm=233472, smem_per_block_optin=232448,
                            regs_per_sm=65536, l2_bytes=60 << 20, cc=(9, 0), max_threads_per_sm=2048,
                            smem_per_block=49152, regs_per_block=65536)
    return SimpleNamespace(ordinal=0, props=props, arch="sm_90", name=name, set_current=lambda: None,
                           enter=lambda: None, streams_checked=set())   # enter(): its context is always current


class FakeKernels(LoadedKernels):
    """LoadedKernels with no module (the real calls(), over fake functions). Records each launch's argument struct (`launches`), grid (`grids`) and whether the merge
    kernel follows (`merges`); `enqueued` lists every kernel call as (call, argument bytes)."""
    _next_handle = 0xD000

    def __init__(self, spec):
        self.rendered = render(spec, "h200")
        self.ctas_per_sm = 2
        FakeKernels._next_handle += 0x10   # distinct functions per spec, as loaded modules have
        self.kernel = self.decode = SimpleNamespace(handle=FakeKernels._next_handle, name="decode", owner=self)
        self.merge = SimpleNamespace(handle=FakeKernels._next_handle + 1, name="merge", owner=self)
        self.merge_ctas, self.pdl_capable = 264, True
        self.launches, self.grids, self.merges, self.enqueued = [], [], [], []

    def num_ctas(self, num_kv_heads):
        return max(1, 132 * 2 // num_kv_heads)

    def record(self, calls, stream):
        mine = next(c for c in calls if getattr(c.function, "owner", None) is self)   # (a cascade's is second)
        self.launches.append(bytes(mine.params))
        self.grids.append(mine.grid[:2])
        self.merges.append(len(calls) > 1)
        self.enqueued += [(c, bytes(c.params)) for c in calls]


class FakePrefillKernels(LoadedKernels):
    """The prefill family's LoadedKernels with no module (the real calls(), over fake functions).
    Records every enqueued launch as (kernel names, grid of the first, argument bytes)."""

    def __init__(self, spec, tile):
        self.rendered = render_prefill(spec, tile)
        self.ctas_per_sm, self.pdl_capable = 2, True
        self.kernel = self.attention = SimpleNamespace(handle=0xA0, name="attention", owner=self)
        self.merge = SimpleNamespace(handle=0xA1, name="merge", owner=self)
        self.merge_ctas = 264
        self.enqueued = []

    def num_ctas(self, num_kv_heads):
        return max(1, 132 * 2 // num_kv_heads)

    def record(self, calls, stream):
        self.enqueued.append(([c.name for c in calls], calls[0].grid, bytes(calls[0].params)))


def install_prefill(monkeypatch, **kw) -> list:
    """install(), plus BatchPrefillWrapper on the fake device with FakePrefillKernels; returns the
    list the kernels made are appended to."""
    dev = install(monkeypatch, lambda spec: None, **kw)
    made = []

    def kernels(spec, tile, ordinal):
        made.append(FakePrefillKernels(spec, tile))
        return made[-1]
    monkeypatch.setattr(PW, "current_device", lambda d=None: dev)
    monkeypatch.setattr(PW.family, "prefill_kernels", kernels)
    return made


def fake_enqueue(calls, stream, device=None):
    """rtattn.runtime.launch.enqueue on the fake GPU: the calls' kernels record them."""
    next(c.function.owner for c in calls if hasattr(c.function, "owner")).record(calls, stream)


class FakeBuffer:
    _next = 1 << 20

    def __init__(self, nbytes, device=None):
        self.nbytes, self.ptr = nbytes, FakeBuffer._next
        FakeBuffer._next += (nbytes + 4095) // 4096 * 4096 + 4096
        self.array = np.zeros(nbytes, np.uint8)

    def memset(self, value=0, stream=None):
        self.array[:] = value

    def as_tensor(self, dtype, shape, stream=None):
        return export(self.ptr, shape, dtype, 0)


def install(monkeypatch, kernels, *, device=None, buffer=FakeBuffer, memcpy=lambda *a, **k: None):
    """Point rtattn.wrapper at fakes: `kernels(spec)` makes the kernel object."""
    dev = device or fake_device()
    monkeypatch.setattr(W, "current_device", lambda d=None: dev)
    monkeypatch.setattr(W, "decode_kernels", lambda spec, ordinal: kernels(spec))
    monkeypatch.setattr(B, "Event", lambda timing=False, device=None: SimpleNamespace(record=lambda s=None: None,
                                                                                       synchronize=lambda: None,
                                                                                       handle=None))
    # plan()'s copy and its event go straight to libcuda's calls (one context entry per plan)
    monkeypatch.setattr(libcuda, "copy_htod", lambda dst, src, n, stream: memcpy(dst, src, n))
    monkeypatch.setattr(libcuda, "record_event", lambda event, stream: None)
    monkeypatch.setattr(libcuda, "wait_event", lambda event: None)
    for mod in (W, B):   # the wrapper base holds the shared buffers; the decode wrapper its own outputs
        for name, fake in (("DeviceBuffer", buffer), ("PinnedBuffer", buffer), ("memcpy_htod_async", memcpy),
                           ("memset_d32", lambda ptr, value, count, device=None: None)):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, fake)
    monkeypatch.setattr(launch_mod, "enqueue", fake_enqueue)
    monkeypatch.setattr(launch_mod, "check_stream", lambda handle, device: None)   # one fake device: every stream is its
    return dev
