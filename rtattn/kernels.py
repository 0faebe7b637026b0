"""AttentionSpec -> compiled, loaded decode kernel, and its launch.

The decode kernel merges split-KV partials itself (the last CTA to finish a row merges it),
so one step of attention is one launch. It is launched with programmatic dependent launch
(PDL): the GPU may start it while the previous kernel on the stream drains; the kernel waits
(griddepcontrol.wait) before touching memory, so results are unchanged.
"""
from __future__ import annotations

import functools

from cuda.bindings import driver as cu

from rtattn.codegen.render import Rendered, render
from rtattn.codegen.spec import AttentionSpec
from rtattn.runtime import Device, Module, as_stream, check, compile_to_cubin, pack_params

COMPILE_OPTIONS = ("-lineinfo", "--extra-device-vectorization")


def compile_spec(spec: AttentionSpec, arch: str, quiet: bool | None = None) -> tuple[Rendered, bytes]:
    """Render and compile to CUBIN (through the on-disk cache); needs no GPU."""
    rendered = render(spec)
    cubin = compile_to_cubin(rendered.source, name=spec.uri, arch=arch, options=COMPILE_OPTIONS, quiet=quiet)
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
        self.functions = (self.decode,)  # every kernel a launch enqueues (graph node updates check this)
        self.ctas_per_sm = self.decode.occupancy(self.rendered.threads, self.rendered.smem_bytes)
        if self.ctas_per_sm < 1:
            raise RuntimeError(f"{self.rendered.decode_name} cannot be resident on {self.device.name} "
                               f"({self.rendered.smem_bytes} B shared memory, {self.decode.attributes()})")
        self.pdl = self.device.props.cc >= (9, 0)

    def num_ctas(self, num_kv_heads: int) -> int:
        """Fixed grid x: every SM busy with `ctas_per_sm` CTAs across the KV heads."""
        return max(1, self.device.props.sm_count * self.ctas_per_sm // num_kv_heads)

    def launch(self, params: bytes, num_ctas: int, grid_y: int, stream=None) -> None:
        r = self.rendered
        if not self.pdl:
            self.decode.launch((num_ctas, grid_y, 1), (r.threads, 1, 1), params, r.smem_bytes, stream)
            return
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = num_ctas, grid_y, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = r.threads, 1, 1
        cfg.sharedMemBytes = r.smem_bytes
        cfg.hStream = as_stream(stream).handle
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs, cfg.numAttrs = [attr], 1
        addr, keep = pack_params(params)
        self.device.set_current()
        check(cu.cuLaunchKernelEx(cfg, self.decode.handle, addr, 0), f"cuLaunchKernelEx({r.decode_name})")
        del keep  # the driver copied the arguments at launch


@functools.lru_cache(maxsize=None)
def decode_kernels(spec: AttentionSpec, device_ordinal: int = 0) -> DecodeKernels:
    """One loaded module per (spec, device) per process."""
    return DecodeKernels(spec, Device(device_ordinal))
