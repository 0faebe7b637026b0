"""The decode family's tile policy: how many 16-row MMA tiles a CTA holds for a head group.

Its resource model lives next to the kernel it describes (codegen.render.decode_smem_bytes and
min_blocks_per_sm, mirrored by rtattn::DecodeShape; plan.tiles.KERNEL_RESOURCES["decode"] for
the planner) and its kernel list in rtattn.kernels.DecodeKernels (decode, then merge).
"""
from __future__ import annotations

from rtattn.codegen.spec import AttentionSpec, default_stages

from . import resources


def m_tiles_for(group: int) -> int:
    """16 fused rows (tokens x heads) per CTA up to g = 16, 32 beyond."""
    return 1 if group <= 16 else 2


def spec_for(variant, dtype: str, head_dim: int, group: int, arch: str, kv_dtype: str | None = None) -> AttentionSpec:
    """The decode kernel's spec: a built-in variant gets the tile for the group and the arch's
    stages; a user's spec keeps its tile unless its rows cannot hold the group. `kv_dtype`: the
    caches' element type (None: q's; fp8 caches are the decode family's alone)."""
    if isinstance(variant, AttentionSpec):
        spec = resources.variant_spec(variant, dtype, head_dim, kv_dtype=kv_dtype)
        return spec if spec.rows >= group else spec.with_(m_tiles=m_tiles_for(group))
    return resources.variant_spec(variant, dtype, head_dim, kv_dtype=kv_dtype, m_tiles=m_tiles_for(group),
                                  stages=default_stages(head_dim, arch))
