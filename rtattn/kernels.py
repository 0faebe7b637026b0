"""AttentionSpec -> compiled, loaded decode + merge kernels, and their launches."""
from __future__ import annotations

import functools

from rtattn.codegen.render import Rendered, render
from rtattn.codegen.spec import AttentionSpec
from rtattn.runtime import Device, Module, compile_to_cubin

# The kernels use mma.sync/ldmatrix/cp.async (sm_80+); nothing needs sm_90a.
COMPILE_OPTIONS = ("-lineinfo", "--extra-device-vectorization")
MERGE_CTAS_PER_SM = 4


def compile_spec(spec: AttentionSpec, arch: str, quiet: bool | None = None) -> tuple[Rendered, bytes]:
    """Render and compile to CUBIN (through the on-disk cache); needs no GPU."""
    rendered = render(spec)
    cubin = compile_to_cubin(rendered.source, name=spec.uri, arch=arch, options=COMPILE_OPTIONS, quiet=quiet)
    return rendered, bytes(cubin)


class DecodeKernels:
    """The decode and merge kernels of one spec, loaded on one device."""

    def __init__(self, spec: AttentionSpec, device: Device | None = None):
        self.spec = spec
        self.device = device or Device()
        self.rendered, cubin = compile_spec(spec, self.device.arch)
        self.module = Module.load(cubin, self.device)
        self.decode = self.module.function(self.rendered.decode_name)
        self.merge = self.module.function(self.rendered.merge_name)
        self.decode.set_max_dynamic_smem(self.rendered.smem_bytes)
        self.ctas_per_sm = self.decode.occupancy(self.rendered.threads, self.rendered.smem_bytes)
        if self.ctas_per_sm < 1:
            raise RuntimeError(f"{self.rendered.decode_name} cannot be resident on {self.device.name} "
                               f"({self.rendered.smem_bytes} B shared memory, {self.decode.attributes()})")
        self.merge_ctas = self.device.props.sm_count * MERGE_CTAS_PER_SM

    def num_ctas(self, num_kv_heads: int) -> int:
        """Fixed grid x: every SM busy with `ctas_per_sm` CTAs across the KV heads."""
        return max(1, self.device.props.sm_count * self.ctas_per_sm // num_kv_heads)

    def launch(self, params: bytes, num_ctas: int, grid_y: int, stream=None, merge: bool = True) -> None:
        r = self.rendered
        self.decode.launch((num_ctas, grid_y, 1), (r.threads, 1, 1), params, r.smem_bytes, stream)
        if merge:
            self.merge.launch((self.merge_ctas, 1, 1), (r.merge_threads, 1, 1), params, 0, stream)


@functools.lru_cache(maxsize=None)
def decode_kernels(spec: AttentionSpec, device_ordinal: int = 0) -> DecodeKernels:
    """One loaded module per (spec, device) per process."""
    return DecodeKernels(spec, Device(device_ordinal))
