"""Tile selection and occupancy.

Head-group fusion: the g = H_qo / H_kv query heads that share a KV head are
folded into the row axis (effective rows = query tokens x g), so one K/V load
serves g heads.  The decode kernel (CUDA cores) handles up to `max_rows`
effective rows per CTA, hence tile_q = max(1, max_rows // g) query tokens.
Prefill's tile policy and resource model live with its family (rtattn.families.prefill);
select_tile(kernel="prefill") asks it.

KERNEL_RESOURCES is the one place the decode kernel's author adjusts its resource model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .devices import Device, get_device
from .layout import check_heads

# Per-kernel resource model, keyed by head_dim bucket (<=64, <=128, 256).
# smem = (stages * tile_kv * 2 (K and V) + q_rows) * head_dim * dtype_bytes + extra_smem.
# Decode: cuda_src/decode.cuh (unpadded, swizzled rows; each stage has 512 bytes of slack for
# the warps' float32 combine: extra_smem = 3 x 512; registers from cuobjdump, m_tiles 1);
# 3 stages, 2 where 3 do not fit (d256 on A100), as codegen.default_stages.
KERNEL_RESOURCES = {
    "decode": {
        64: dict(threads=128, regs=164, stages=3, tile_kv=64, extra_smem=1536),
        128: dict(threads=128, regs=244, stages=3, tile_kv=64, extra_smem=1536),
        256: dict(threads=128, regs=255, stages=3, tile_kv=64, extra_smem=1536),
    },
}
DEFAULT_MAX_ROWS = 16


@dataclass(frozen=True)
class TileConfig:
    tile_q: int        # query TOKENS per work item (rows = tile_q * g)
    tile_kv: int       # KV tokens per pipeline stage
    max_rows: int      # effective rows one CTA handles (tile_q * g <= max_rows)
    stages: int
    threads: int
    smem_bytes: int
    kernel: str = "decode"
    regs: int = 168
    ctas_per_sm: int = 1


def _bucket(head_dim: int) -> int:
    if head_dim <= 64:
        return 64
    if head_dim <= 128:
        return 128
    if head_dim <= 256:
        return 256
    raise ValueError(f"head_dim={head_dim} > 256 is not supported")


def smem_bytes(stages: int, tile_kv: int, head_dim: int, dtype_bytes: int = 2,
               extra: int = 1024, q_rows: int = 0) -> int:
    return (stages * tile_kv * 2 + q_rows) * head_dim * dtype_bytes + extra


def occupancy(device: Device, threads: int, regs: int, smem: int) -> int:
    """Resident CTAs per SM, limited by shared memory, registers and threads."""
    if smem > device.smem_per_block_optin:
        return 0
    by_smem = device.smem_per_sm // (smem + device.smem_reserved_per_block)
    regs_warp = -(-regs * 32 // 256) * 256          # allocation granularity: 256 regs/warp
    by_regs = device.regs_per_sm // (regs_warp * (threads // 32))
    by_threads = device.max_threads_per_sm // threads
    return max(0, min(by_smem, by_regs, by_threads, device.max_blocks_per_sm))


def num_ctas_for(device, tile: TileConfig, num_kv_heads: int) -> int:
    """Fixed grid x-dimension: SMs x CTAs-per-SM / H_kv, at least 1."""
    dev = get_device(device)
    return max(1, dev.sm_count * max(1, tile.ctas_per_sm) // num_kv_heads)


def select_tile(device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                max_qo_len: int = 1, *, kernel: str = "decode",
                max_rows: int | None = None, avg_qo_len: float | None = None,
                dtype_bytes: int = 2) -> TileConfig:
    dev = get_device(device)
    g = check_heads(num_qo_heads, num_kv_heads)
    if kernel == "prefill":
        # The prefill family owns its tile policy and resource model (rtattn.families.prefill).
        from rtattn.families import prefill as family
        avg = avg_qo_len if avg_qo_len is not None else max_qo_len
        tile = family.choose_tile(dev, head_dim, g, avg, rows=max_rows if max_rows in family.ROWS else None)
        cfg = family.tile_config(tile, head_dim, g)
        if max_qo_len < cfg.tile_q:   # a tile never needs more tokens than the longest query
            cfg = replace(cfg, tile_q=max(1, max_qo_len))
        return cfg
    if kernel != "decode":
        raise ValueError(f"kernel must be one of ['decode', 'prefill'], got {kernel!r}")
    res = KERNEL_RESOURCES[kernel][_bucket(head_dim)]
    if max_rows is None:
        max_rows = DEFAULT_MAX_ROWS if g <= DEFAULT_MAX_ROWS else 32
    if g > max_rows:
        raise ValueError(f"head group g={g} (={num_qo_heads}/{num_kv_heads}) exceeds "
                         f"max_rows={max_rows} of the decode kernel")
    tile_q = max(1, min(max_rows // g, max(1, max_qo_len)))
    tile_kv = res["tile_kv"]
    for stages in (res["stages"], 2):
        smem = smem_bytes(stages, tile_kv, head_dim, dtype_bytes, res["extra_smem"], max_rows)
        if smem <= dev.smem_per_block_optin:
            break
    occ = occupancy(dev, res["threads"], res["regs"], smem)
    if occ == 0:
        raise ValueError(f"decode tile (stages={stages}, tile_kv={tile_kv}, "
                         f"head_dim={head_dim}) needs {smem} B smem > opt-in "
                         f"{dev.smem_per_block_optin} B on {dev.name}")
    return TileConfig(tile_q, tile_kv, max_rows, stages, res["threads"], smem, "decode",
                      res["regs"], occ)
