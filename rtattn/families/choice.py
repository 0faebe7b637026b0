"""Which kernel family runs a batch: a cost rule per family, from figures measured on the H200.

Both families can run any ragged batch over a paged cache; they differ in how many fused rows
(query tokens x head group) one read of the KV serves: a decode CTA holds 16 or 32 rows
(m_tiles 1 or 2; 16 at head_dim 256), a prefill tile 16 to 128 (families.prefill.choose_tile).
Multi-token decode (q_len 2-16: speculative and tree verification) and wide head groups
(g >= 16) sit where the two meet. For a batch of `batch` requests of q_len query tokens over
kv_len KV tokens each, family f with tiles of R_f fused rows (tile_q_f = R_f // g tokens):

    reads_f  = ceil(q_len / tile_q_f)                    KV reads per request and KV head
    bytes_f  = batch * (reads_f * kv_len * H_kv * 2D * kv_bytes + q_len * H_qo * 2D * 2)
    flops_f  = batch * reads_f * kv_len * H_kv * 4 * R_f * D    (the MMA's rows, padding included)
    t_f (us) = FIXED_US + max(bytes_f / hbm_f, flops_f / mma_f)

The family with the smaller t_f runs the batch; a tie (within TIE, about the model's error)
goes to decode, the family one-token steps already run on. The choice is made once, for the
sizes a wrapper is built for (rtattn.multi_token_wrapper, rtattn-inspect), not per plan():
a captured graph fixes its kernels, and plans change underneath it. Every constant is a
`FamilyCost` field, overridable (`costs=`), and the choice itself can be forced
(`family="decode" | "prefill"`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rtattn.plan import devices as plan_devices

from . import decode, prefill

FAMILIES = ("decode", "prefill")
TIE = 0.03   # predictions closer than this pick decode (the model is no better than ~3-5% here)


@dataclass(frozen=True)
class FamilyCost:
    """The cost rule's constants for one family (H200, bf16, docs/perf-log.md):
    hbm_tbps    KV read rate of a memory-bound step, after FIXED_US
    mma_tflops  the family's matrix rate on a compute-bound step
    fixed_us    launch, pipeline fill and tail of one step (both kernels plus the merge)"""
    hbm_tbps: float
    mma_tflops: float
    fixed_us: float


# decode: hbm from v6 s256x4096 (4299 MB in 962.4 us, less fixed: 4.50 TB/s); fixed from v6
# b16-all1024-kv8 (22.2 us for 67.4 MB: 7.2 us over the bytes at 4.50); mma from v6
# g32-64x2048 (m_tiles 2: 26.9 us, 2.15 GFLOP of 32-row MMAs -> 108 TFLOP/s after fixed; the
# only decode row that is not memory-bound).
# prefill: hbm from v7 mtd64x4096-q4 (1079 MB in 248 us, less fixed: 4.48 TB/s; -q1 245 us);
# mma from v7 1x16384 causal (277 TFLOP/s over attended pairs); fixed: not measured on a small
# batch yet, taken as decode's (bench_prefill.py's mtd16x1024-q4 row measures it).
COSTS = {"decode": FamilyCost(hbm_tbps=4.50, mma_tflops=108.0, fixed_us=7.2),
         "prefill": FamilyCost(hbm_tbps=4.48, mma_tflops=277.0, fixed_us=7.2)}


@dataclass(frozen=True)
class FamilyChoice:
    family: str               # "decode" or "prefill"
    estimates_us: dict        # family -> predicted step time (us)
    rows: dict                # family -> fused rows per tile
    reason: str               # one line: what decided it

    def __str__(self) -> str:
        est = ", ".join(f"{f} {self.estimates_us[f]:.1f} us ({self.rows[f]} rows)" for f in FAMILIES)
        return f"{self.family}: {self.reason} [{est}]"


def tile_rows(family: str, group: int, head_dim: int, qo_len: int, device="h200") -> int:
    """Fused rows per tile that `family` uses for queries of qo_len tokens (its own tile policy)."""
    if family == "decode":
        return 16 * decode.tile_m_tiles(group, qo_len * group, head_dim)
    return prefill.choose_tile(plan_devices.get_device(device), head_dim, group, qo_len).rows


def estimate_us(family: str, num_qo_heads: int, num_kv_heads: int, head_dim: int, qo_len: int, kv_len: float,
                batch: int = 1, kv_bytes: int = 2, device="h200", costs: dict | None = None,
                rows: int | None = None) -> tuple[float, int]:
    """(predicted step time in us, fused rows per tile) of `family` (module docstring's rule);
    `rows`: the tile a kernel was built with, where it is not the family's policy for qo_len."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    c = (costs or COSTS)[family]
    g = num_qo_heads // num_kv_heads
    rows = rows or tile_rows(family, g, head_dim, qo_len, device)
    reads = math.ceil(qo_len / max(1, rows // g))
    kv_tokens = batch * reads * kv_len * num_kv_heads
    nbytes = kv_tokens * 2 * head_dim * kv_bytes + batch * qo_len * num_qo_heads * 2 * head_dim * 2
    flops = kv_tokens * 4 * rows * head_dim
    return c.fixed_us + max(nbytes / (c.hbm_tbps * 1e6), flops / (c.mma_tflops * 1e6)), rows


def choose_family(num_qo_heads: int, num_kv_heads: int, head_dim: int, qo_len: int, kv_len: float,
                  batch: int = 1, *, family: str = "auto", kv_bytes: int = 2, device="h200",
                  costs: dict | None = None) -> FamilyChoice:
    """The family whose predicted time is smaller (ties within TIE: decode). `family` other than
    "auto" forces it (the estimates are still reported). fp8 caches (kv_bytes 1) run on the
    decode family only."""
    if family not in FAMILIES + ("auto",):
        raise ValueError(f"family must be 'auto' or one of {FAMILIES}, got {family!r}")
    if not isinstance(qo_len, int) or qo_len < 1:
        raise ValueError(f"qo_len must be a positive int (query tokens per request), got {qo_len!r}")
    est, rows = {}, {}
    for f in FAMILIES:
        est[f], rows[f] = estimate_us(f, num_qo_heads, num_kv_heads, head_dim, qo_len, kv_len, batch, kv_bytes,
                                      device, costs)
    group = num_qo_heads // num_kv_heads
    if rows["decode"] < group:   # (its rows hold at least the group wherever the kernel exists)
        if family == "decode" or kv_bytes == 1:
            raise ValueError(f"head group {group} exceeds the decode kernel's {rows['decode']} rows "
                             f"at head_dim {head_dim}")
        return FamilyChoice("prefill", est, rows, f"the head group exceeds the decode kernel's {rows['decode']} rows")
    if family != "auto":
        return FamilyChoice(family, est, rows, "forced")
    if kv_bytes == 1:
        return FamilyChoice("decode", est, rows, "fp8 KV: only the decode family reads it")
    if est["prefill"] < est["decode"] * (1 - TIE):
        return FamilyChoice("prefill", est, rows, "predicted faster by more than the tie margin")
    return FamilyChoice("decode", est, rows, "predicted within the tie margin or faster")


def shared_group_saving_us(num_qo_heads: int, num_kv_heads: int, head_dim: int, qo_len: int, kv_len: int,
                           device="h200", costs: dict | None = None, prefill_rows: int | None = None) -> float:
    """Predicted microseconds a cascade's shared group (qo_len queries of several requests over
    kv_len shared KV tokens) saves on prefill tiles (of `prefill_rows` fused rows: the cascade's
    tile; None: the family's policy for qo_len) over decode tiles: the difference of the two
    families' byte/FLOP terms, fixed costs excluded (the cascade's kernels run anyway; the prefill
    kernel's own launch is what rtattn.plan.cascade.PREFILL_MIN_SAVING_US must beat)."""
    c = costs or COSTS
    dec, _ = estimate_us("decode", num_qo_heads, num_kv_heads, head_dim, qo_len, kv_len, 1, 2, device, costs)
    pre, _ = estimate_us("prefill", num_qo_heads, num_kv_heads, head_dim, qo_len, kv_len, 1, 2, device, costs,
                         rows=prefill_rows)
    return (dec - c["decode"].fixed_us) - (pre - c["prefill"].fixed_us)


# The cascade's flat-or-levels choice for one shared prefix under decode requests
# (rtattn.plan.cascade: a prefix the family rule keeps on decode tiles). Both plans read each
# request's own pages once and the prefix once from HBM; they differ in
#   flat    (B - 1) further reads of the prefix, served by L2 (every request's CTAs read it at
#           about the same time): L2_REREAD_TBPS fitted from rtattn single-format decode on the
#           six PERF.md cascade rows (H200, docs/perf-log.md "Cascade v4" rt single: 10.3-11.6
#           TB/s over the re-read bytes after FIXED_US and the unique bytes at hbm_tbps);
#   levels  ceil(B / tile_q) - 1 further reads of it, and per query its level states written,
#           folded and its suffix an item of its own: CASCADE_QUERY_US per query at 32 x 128
#           query-head columns (fitted from "Cascade v4" rt-dec p1024x16 and p1024x64, 0.43 and
#           0.35 us after the same byte terms), scaled by H_qo * D.
L2_REREAD_TBPS = 11.0
CASCADE_QUERY_US = 0.4


def flat_saving_us(num_qo_heads: int, num_kv_heads: int, head_dim: int, batch: int, prefix_tokens: int,
                   decode_tile_q: int, kv_bytes: int = 2) -> float:
    """Predicted microseconds the flat plan (each request's whole page list, one level: rtattn's
    single format) saves over the cascade's levels for `batch` decode requests over one shared
    prefix of `prefix_tokens` read by decode tiles of `decode_tile_q` queries (the model above;
    the terms both plans share cancel). Positive: flat is predicted faster."""
    token_bytes = num_kv_heads * head_dim * 2 * kv_bytes
    extra_reads = batch - math.ceil(batch / decode_tile_q)   # the flat plan's further prefix reads
    levels_us = CASCADE_QUERY_US * batch * num_qo_heads * head_dim / (32 * 128)
    return levels_us - extra_reads * prefix_tokens * token_bytes / (L2_REREAD_TBPS * 1e6)
