"""Tile selection and occupancy.

Head-group fusion: the g = H_qo / H_kv query heads that share a KV head are
folded into the row axis (effective rows = query tokens x g), so one K/V load
serves g heads.  The decode kernel (CUDA cores) handles up to `max_rows`
effective rows per CTA, hence tile_q = max(1, max_rows // g) query tokens.

Each family owns its tile policy and resource model (rtattn.families.decode, .prefill);
select_tile(kernel=...) asks the family.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .devices import Device, get_device
from .layout import check_heads

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
                invariant: bool = False) -> TileConfig:
    """The tile of `kernel`'s family for these heads (its owner decides: rtattn.families);
    `invariant`: the decode kernel's batch-invariant build."""
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
    from rtattn.families import decode as family
    return family.tile_config(dev, g, head_dim, max_qo_len, max_rows, invariant)
