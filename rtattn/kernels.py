"""AttentionSpec -> compiled, loaded decode (+ merge) kernels, and the kernel calls of a launch.

Split-KV partials are merged by a small persistent merge kernel right after the decode kernel.
(Merging inside the decode kernel -- the last CTA of a split row merges it -- was measured
slower on every small-batch row: docs/perf-log.md.)

Launches use programmatic dependent launch (PDL) on sm_90: each kernel lets its dependent
launch at once (griddepcontrol.launch_dependents), so the next kernel on the stream starts
while this one runs; it reads only the plan (an H2D copy's output, complete before either
kernel started) until griddepcontrol.wait, which returns when the previous kernel has finished
and its writes are visible. Results are unchanged.

RTATTN_DEV_DEFINES (environment): extra -D flags for A/B builds of experimental #ifdef paths, decode and prefill
(tools/bench_decode.py --rt-modes MODE+D<NAME>); part of the compile cache key.
"""
from __future__ import annotations

import functools
import os
import re

from rtattn.codegen.render import MERGE_THREADS, Rendered
from rtattn.codegen.spec import AttentionSpec
from rtattn.families import decode as family
from rtattn.families import resources
from rtattn.plan import devices as plan_devices
from rtattn.runtime import Device, Module, compile_to_cubin
from rtattn.runtime.launch import KernelCall, Params

COMPILE_OPTIONS = ("-lineinfo", "--extra-device-vectorization")
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


def dev_defines() -> tuple[str, ...]:
    """RTATTN_DEV_DEFINES' -D flags for A/B builds of experimental #ifdef paths (every family)."""
    return tuple(os.environ.get("RTATTN_DEV_DEFINES", "").split())


def compile_spec(spec: AttentionSpec, arch: str, quiet: bool | None = None, device=None) -> tuple[Rendered, bytes]:
    """Render (with the decode family's resource numbers for `device`, a plan.devices.Device;
    None: the named description of `arch`) and compile to CUBIN (through the on-disk cache);
    needs no GPU."""
    check_arch(arch)
    rendered = family.render(spec, device or resources.device_for_arch(arch))
    cubin = compile_to_cubin(rendered.source, name=spec.uri, arch=arch, options=COMPILE_OPTIONS + dev_defines(),
                             quiet=quiet)
    return rendered, bytes(cubin)


class LoadedKernels:
    """A family's attention kernel and the split-KV merge kernel of one compiled source, loaded on
    one device: the fixed grid and the kernel calls of a launch (decode and prefill share these)."""

    def __init__(self, rendered, cubin: bytes, kernel_name: str, device: Device):
        self.rendered, self.device = rendered, device
        self.module = Module.load(cubin, device)
        self.kernel = self.module.function(kernel_name)
        self.kernel.set_max_dynamic_smem(rendered.smem_bytes)
        self.merge = self.module.function(rendered.merge_name)
        self.merge_ctas = device.props.sm_count * resources.MERGE_CTAS_PER_SM
        self.ctas_per_sm = resources.resident_ctas(self.kernel, rendered, device)
        self.pdl_capable = device.props.cc >= (9, 0)

    def num_ctas(self, num_kv_heads: int) -> int:
        """Fixed grid x: every SM busy with `ctas_per_sm` CTAs across the KV heads."""
        return resources.grid_ctas(self.device, self.ctas_per_sm, num_kv_heads)

    def calls(self, params: Params, num_ctas: int, grid_y: int, merge: bool = True,
              pdl: bool = True) -> list[KernelCall]:
        """The attention kernel, then the merge kernel (when the plan may split KV), both reading
        `params`; prepared once per wrapper or graph binding, enqueued by rtattn.runtime.launch."""
        r = self.rendered
        pdl = pdl and self.pdl_capable
        out = [KernelCall(self.kernel, (num_ctas, grid_y, 1), (r.threads, 1, 1), r.smem_bytes, params, pdl)]
        if merge:
            out.append(KernelCall(self.merge, (self.merge_ctas, 1, 1), (MERGE_THREADS, 1, 1), 0, params, pdl))
        return out


class DecodeKernels(LoadedKernels):
    """The decode kernel of one spec, loaded on one device."""

    def __init__(self, spec: AttentionSpec, device: Device | None = None):
        self.spec = spec
        device = device or Device()
        rendered, cubin = compile_spec(spec, device.arch, device=plan_devices.from_props(device.props))
        super().__init__(rendered, cubin, rendered.decode_name, device)
        self.decode = self.kernel


@functools.lru_cache(maxsize=None)
def decode_kernels(spec: AttentionSpec, device_ordinal: int = 0) -> DecodeKernels:
    """One loaded module per (spec, device) per process."""
    return DecodeKernels(spec, Device(device_ordinal))
