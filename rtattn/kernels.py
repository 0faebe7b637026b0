"""AttentionSpec -> compiled, loaded decode (+ merge) kernels, and their launch.

Split-KV partials are merged by a small persistent merge kernel right after the decode kernel.
(Merging inside the decode kernel -- the last CTA of a split row merges it -- was measured
slower on every small-batch row: docs/perf-log.md.)

Launches use programmatic dependent launch (PDL) on sm_90: each kernel lets its dependent
launch at once (griddepcontrol.launch_dependents), so the next kernel on the stream starts
while this one runs; it reads only the plan (an H2D copy's output, complete before either
kernel started) until griddepcontrol.wait, which returns when the previous kernel has finished
and its writes are visible. Results are unchanged.

RTATTN_DEV_DEFINES (environment): extra -D flags for A/B builds of experimental #ifdef paths
(tools/bench_decode.py --rt-modes MODE+D<NAME>); part of the compile cache key.
"""
from __future__ import annotations

import functools
import os
import re

from cuda.bindings import driver as cu

from rtattn.codegen.render import MERGE_THREADS, Rendered, render
from rtattn.codegen.spec import AttentionSpec
from rtattn.runtime import Device, Module, as_stream, check, compile_to_cubin, pack_params

COMPILE_OPTIONS = ("-lineinfo", "--extra-device-vectorization")
MERGE_CTAS_PER_SM = 2
MIN_SM = 80   # cp.async, ldmatrix and bf16 mma.sync: Ampere or newer


def check_arch(arch) -> str:
    """A real architecture the kernels can be built for, else one clear ValueError (NVRTC's own
    answer to sm_75 is hundreds of lines)."""
    m = re.fullmatch(r"sm_(\d{2,3})[af]?", arch) if isinstance(arch, str) else None
    if not m:
        raise ValueError(f"arch {arch!r}: expected a real GPU architecture such as sm_80, sm_90, sm_90a")
    if int(m.group(1)) < MIN_SM:
        raise ValueError(f"arch {arch}: the kernels need sm_{MIN_SM} or newer")
    return arch


def compile_spec(spec: AttentionSpec, arch: str, quiet: bool | None = None) -> tuple[Rendered, bytes]:
    """Render and compile to CUBIN (through the on-disk cache); needs no GPU."""
    check_arch(arch)
    rendered = render(spec)
    dev = tuple(os.environ.get("RTATTN_DEV_DEFINES", "").split())  # -D flags for A/B experiments
    cubin = compile_to_cubin(rendered.source, name=spec.uri, arch=arch, options=COMPILE_OPTIONS + dev, quiet=quiet)
    return rendered, bytes(cubin)


class DecodeKernels:
    """The decode kernel of one spec, loaded on one device."""

    def __init__(self, spec: AttentionSpec, device: Device | None = None):
        self.spec = spec
        self.device = device or Device()
        self.rendered, cubin = compile_spec(spec, self.device.arch)
        self.module = Module.load(cubin, self.device)
        self.decode = self.module.function(self.rendered.decode_name)
        self.decode.set_max_dynamic_smem(self.rendered.smem_bytes)
        self.merge = self.module.function(self.rendered.merge_name)
        self.functions = (self.decode, self.merge)  # every kernel a launch enqueues (graph node updates check this)
        self.merge_ctas = self.device.props.sm_count * MERGE_CTAS_PER_SM
        self.ctas_per_sm = self.decode.occupancy(self.rendered.threads, self.rendered.smem_bytes)
        if self.ctas_per_sm < 1:
            raise RuntimeError(f"{self.rendered.decode_name} cannot be resident on {self.device.name} "
                               f"({self.rendered.smem_bytes} B shared memory, {self.decode.attributes()})")
        self.pdl_capable = self.device.props.cc >= (9, 0)

    def num_ctas(self, num_kv_heads: int) -> int:
        """Fixed grid x: every SM busy with `ctas_per_sm` CTAs across the KV heads."""
        return max(1, self.device.props.sm_count * self.ctas_per_sm // num_kv_heads)

    def launch(self, params: bytes, num_ctas: int, grid_y: int, stream=None, merge: bool = True,
               pdl: bool = True) -> None:
        """Enqueue the decode kernel, then the merge kernel (when the plan may split KV)."""
        r = self.rendered
        pdl = pdl and self.pdl_capable
        self._launch(self.decode, (num_ctas, grid_y, 1), r.threads, r.smem_bytes, params, stream, pdl)
        if merge:
            self._launch(self.merge, (self.merge_ctas, 1, 1), MERGE_THREADS, 0, params, stream, pdl)

    def _launch(self, fn, grid, threads: int, smem: int, params: bytes, stream, pdl: bool) -> None:
        if not pdl:
            fn.launch(grid, (threads, 1, 1), params, smem, stream)
            return
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
        cfg.sharedMemBytes = smem
        cfg.hStream = as_stream(stream).handle
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs, cfg.numAttrs = [attr], 1
        addr, keep = pack_params(params)
        self.device.set_current()
        check(cu.cuLaunchKernelEx(cfg, fn.handle, addr, 0), f"cuLaunchKernelEx({fn.name})")
        del keep  # the driver copied the arguments at launch


@functools.lru_cache(maxsize=None)
def decode_kernels(spec: AttentionSpec, device_ordinal: int = 0) -> DecodeKernels:
    """One loaded module per (spec, device) per process."""
    return DecodeKernels(spec, Device(device_ordinal))
