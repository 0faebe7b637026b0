"""The decode family: tile policy and resource model, one place for the planner, the renderer and
the kernel.

A CTA holds 16 x m_tiles fused rows (query tokens x head group) and walks the KV in blocks of
16 tokens per warp. Its shared memory (`smem_bytes`, the mirror of rtattn::DecodeShape, checked
by a static_assert in the source), its pipeline depth (`stages_for`) and the CTAs per SM it is
compiled for (`min_blocks`, __launch_bounds__) come from the device's real limits (named
descriptions per arch for ahead-of-time builds, families.resources); the planner's tile
(`tile_config`) reads the same numbers. Its kernel list is rtattn.kernels.DecodeKernels (decode,
then merge).
"""
from __future__ import annotations

from rtattn.codegen.render import Rendered, render_decode
from rtattn.codegen.spec import BUILTINS, DTYPES, FP8_DTYPES, HEAD_DIMS, AttentionSpec, max_m_tiles
from rtattn.plan import devices as plan_devices

from . import resources

NUM_WARPS = 4
MAX_STAGES = 3
MAX_CTAS_PER_SM = 2   # __launch_bounds__ cap: 255 registers per thread at 128 threads fit 2 CTAs
# Registers per thread at m_tiles 1 (cuobjdump of the shipped sm_90 instances): what occupancy on
# a named device (the planner without a GPU) assumes; a loaded kernel's occupancy is the driver's.
REGISTERS = {64: 164, 128: 244, 256: 255}


def m_tiles_for(rows: int) -> int:
    """16 fused rows (tokens x heads) per CTA up to 16, 32 beyond."""
    return 1 if rows <= 16 else 2


def rows_m_tiles(rows: int, head_dim: int) -> int:
    """16-row tiles a CTA holds for `rows` fused rows: two only where the registers hold them."""
    return min(m_tiles_for(rows), max_m_tiles(head_dim))


def tile_m_tiles(group: int, rows: int, head_dim: int) -> int:
    """16-row tiles a CTA holds for queries of `rows` fused rows: at least the group's."""
    return max(m_tiles_for(group), rows_m_tiles(rows, head_dim))


def smem_bytes(spec: AttentionSpec) -> int:
    """Mirror of rtattn::DecodeShape::smem_bytes: the 16-bit q tile, then the KV stages; each
    stage also fits the warps' float32 combine (rows + m, l), which reuses the stage that is free
    at an item's end. A batch-invariant build adds its fold state (rtattn::fold_state_bytes)."""
    q = spec.rows * spec.head_dim * 2
    kv = 2 * spec.num_warps * 16 * spec.head_dim * (1 if spec.kv_is_fp8 else 2)
    combine = spec.num_warps * 16 * (spec.head_dim + 2) * 4
    fold = spec.rows * (spec.head_dim + 4) * 4 if spec.invariant else 0   # o, then (m, l) twice
    return q + spec.stages * max(kv, combine) + fold


def stages_for(spec: AttentionSpec, device) -> int:
    """The deepest pipeline (MAX_STAGES, else 2) whose shared memory one block may use. A
    batch-invariant build also keeps the auto build's CTAs per SM: its fold state must not cost
    a resident CTA (d128 with two row tiles: 3 stages would fit one CTA per SM, 2 fit two)."""
    dev = plan_devices.get_device(device)
    for stages in range(MAX_STAGES, 2, -1):
        s = spec.with_(stages=stages)
        if smem_bytes(s) > dev.smem_per_block_optin:
            continue
        if spec.invariant and min_blocks(s, dev) < min_blocks(spec.with_(invariant=False, stages=stages), dev):
            continue
        return stages
    return 2


def min_blocks(spec: AttentionSpec, device) -> int:
    """CTAs per SM the kernel is compiled for: as many as the device's shared memory holds, at
    most MAX_CTAS_PER_SM."""
    return resources.blocks_by_smem(plan_devices.get_device(device), smem_bytes(spec), MAX_CTAS_PER_SM)


def render(spec: AttentionSpec, device) -> Rendered:
    """The decode (+ merge) source of `spec` with this family's resource numbers for `device`."""
    return render_decode(spec, smem_bytes(spec), min_blocks(spec, device))


def spec_for(variant, dtype: str, head_dim: int, group: int, arch: str, kv_dtype: str | None = None,
             rows: int | None = None) -> AttentionSpec:
    """The decode kernel's spec: a built-in variant gets the tile for `rows` fused rows (default:
    the group, i.e. one query token; 16 at head_dim 256) and the stages it fits on `arch`; a user's spec keeps its tile unless
    its rows cannot hold the group. `kv_dtype`: the caches' element type (None: q's; fp8 caches
    are the decode family's alone)."""
    if isinstance(variant, AttentionSpec):
        spec = resources.variant_spec(variant, dtype, head_dim, kv_dtype=kv_dtype)
        return spec if spec.rows >= group else spec.with_(m_tiles=m_tiles_for(group))
    spec = resources.variant_spec(variant, dtype, head_dim, kv_dtype=kv_dtype,
                                  m_tiles=tile_m_tiles(group, rows or group, head_dim))
    return spec.with_(stages=stages_for(spec, resources.device_for_arch(arch)))


def invariant_build(spec: AttentionSpec, arch: str) -> AttentionSpec:
    """`spec`'s batch-invariant build: where the family chose its stages (stages_for), it chooses
    them again for the build's shared memory; a user's own stages stay."""
    dev = resources.device_for_arch(arch)
    inv = spec.with_(invariant=True)
    return inv.with_(stages=stages_for(inv, dev)) if spec.stages == stages_for(spec, dev) else inv


def builtin(make, arch: str, **fields) -> AttentionSpec:
    """A built-in variant's spec with the stages its tile fits on `arch`."""
    spec = make(**fields)
    return spec.with_(stages=stages_for(spec, resources.device_for_arch(arch)))


def shipped(arch: str = "sm_90") -> list[AttentionSpec]:
    """Every decode instance the package ships for `arch` (what rtattn-compile warms): every
    built-in at every 16-bit type, head dim and row tile, and its batch-invariant build at bf16;
    with an fp8 cache, bf16 q and 16 fused rows: every built-in and head dim for e4m3, plain
    attention for e5m2 (the rest compile on first use, ~1 s each: CI compiles every shipped
    instance for two archs on 2 cores)."""
    out = []
    for make in BUILTINS.values():
        for dtype in DTYPES:
            for head_dim in HEAD_DIMS:
                for m_tiles in range(1, max_m_tiles(head_dim) + 1):
                    spec = builtin(make, arch, dtype=dtype, head_dim=head_dim, m_tiles=m_tiles)
                    out += [spec, invariant_build(spec, arch)] if dtype == "bfloat16" else [spec]
        for kv_dtype in FP8_DTYPES if make is BUILTINS["plain"] else ("float8_e4m3fn",):
            for head_dim in HEAD_DIMS:
                out.append(builtin(make, arch, dtype="bfloat16", kv_dtype=kv_dtype, head_dim=head_dim))
    return out


def tile_config(device, group: int, head_dim: int, max_qo_len: int = 1, max_rows: int | None = None,
                invariant: bool = False):
    """The planner's view of the decode tile for a head group: tile_q query tokens per work item
    (max_rows // g, at most the longest query), the kernel's stages, shared memory and CTAs per
    SM on `device` (occupancy by shared memory, REGISTERS and threads)."""
    from rtattn.plan.tiles import TileConfig, occupancy
    dev = plan_devices.get_device(device)
    if max_rows is None:
        max_rows = 16 * m_tiles_for(group)
    if group > max_rows:
        raise ValueError(f"head group g={group} exceeds max_rows={max_rows} of the decode kernel")
    # (at d256 one 16-row tile even where max_rows is 32: the planner still takes max_rows)
    spec = AttentionSpec("plain", "plain", head_dim=head_dim, m_tiles=rows_m_tiles(max_rows, head_dim),
                         num_warps=NUM_WARPS, invariant=invariant)   # (the batch-invariant build: its fold state too)
    spec = spec.with_(stages=stages_for(spec, dev))
    smem, threads, regs = smem_bytes(spec), 32 * NUM_WARPS, REGISTERS[head_dim]
    occ = occupancy(dev, threads, regs, smem)
    if occ == 0:
        raise ValueError(f"decode tile (stages={spec.stages}, head_dim={head_dim}) needs {smem} B of shared "
                         f"memory, more than the {dev.smem_per_block_optin} B one block may use on {dev.name}")
    tile_q = max(1, min(max_rows // group, max(1, max_qo_len)))
    return TileConfig(tile_q, NUM_WARPS * 16, max_rows, spec.stages, threads, smem, "decode", regs, occ)
