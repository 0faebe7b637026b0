"""rtattn-inspect --shared-prefix: the cascade levels of a shared-prefix batch and what each reads.

    rtattn-inspect --shared-prefix 8192 --batch 64 --kv-dist const:128
    rtattn-inspect --shared-prefix 1024 --groups 8:4096 --batch 64 --levels 3 --json

Every request's KV is the shared prefix, then (with --groups G:T) its group's own T tokens,
then its own tokens from --kv-dist. The levels are found from the page ids alone
(share_prefixes, as CascadeWrapper.plan(..., share_prefixes=True) does), and each group goes to
the kernel family CascadeWrapper gives it (prefill tiles for groups of many queries; with
--kernel decode every group on decode, as CascadeWrapper(prefill=False)).
"""
from __future__ import annotations

import time

import numpy as np

from . import CliError


def shared_prefix_batch(prefix: int, groups: tuple[int, int] | None, own, page_size: int, seed: int):
    """Page tables: prefix pages shared by all, group pages by each of `groups[0]` contiguous
    groups, own pages per request; page ids scattered."""
    B = len(own)
    ng, gt = groups or (1, 0)
    pp, gp = -(-prefix // page_size), -(-gt // page_size)
    op = -(-np.asarray(own, np.int64) // page_size)
    ids = np.random.default_rng(seed).permutation(pp + ng * gp + int(op.sum())).astype(np.int32)
    group_of = np.arange(B) * ng // B
    at = pp + ng * gp
    reqs = []
    for b in range(B):
        g = group_of[b]
        reqs.append(np.concatenate([ids[:pp], ids[pp + g * gp:pp + (g + 1) * gp], ids[at:at + op[b]]]))
        at += op[b]
    kv_indptr = np.zeros(B + 1, np.int32)
    kv_indptr[1:] = np.cumsum([len(r) for r in reqs])
    last = (np.asarray(own) - (op - 1) * page_size).astype(np.int32)
    return kv_indptr, np.concatenate(reqs), last, len(ids)


def analyze_cascade(a, own, hq: int, hk: int) -> dict:
    from rtattn.cascade import default_m_tiles, shared_level_kw
    from rtattn.plan.cascade import CascadePlanner
    from rtattn.plan.devices import get_device
    groups = None
    if a.groups:
        try:
            groups = tuple(int(x) for x in a.groups.split(":"))
            assert len(groups) == 2 and groups[0] >= 1 and groups[1] >= 0
        except (ValueError, AssertionError):
            raise CliError(f"--groups {a.groups!r}: expected GROUPS:TOKENS, e.g. 8:4096") from None
    if a.shared_prefix < 0 or a.levels < 1:
        raise CliError(f"--shared-prefix must be >= 0 and --levels >= 1, got {a.shared_prefix} and {a.levels}")
    own = np.maximum(np.asarray(own, np.int64), 1)
    kv_indptr, idx, last, pool = shared_prefix_batch(a.shared_prefix, groups, own, a.page_size, a.seed)
    B = len(own)
    g = hq // hk
    rows = 16 * default_m_tiles(g, a.head_dim)   # (CascadeWrapper's decode rows)
    shared = {} if a.kernel == "decode" else shared_level_kw(get_device(a.device), hq, hk, a.head_dim, a.page_size, B)
    cp = CascadePlanner.create(B, B, pool, hq, hk, a.head_dim, a.page_size, num_levels=a.levels, device=a.device,
                               mode=a.mode, max_rows=rows, **shared)
    buf = cp.planset.allocate()
    info = cp.plan_shared(None, kv_indptr, idx, last, out=buf)
    ts = []
    for _ in range(max(1, a.reps)):
        t = time.perf_counter()
        cp.plan_shared(None, kv_indptr, idx, last, out=buf)
        ts.append(time.perf_counter() - t)
    u = info.union
    if u is None:   # the one-prefix fast path plans without the union's arrays: build them to show them
        from rtattn.plan.layout import validate_batch
        from rtattn.plan.prefix_tree import prefix_union
        u = prefix_union(validate_batch(None, kv_indptr, idx, last, a.page_size), a.levels)
    levels = []
    for lvl in range(info.num_levels):
        mine = np.flatnonzero(u.level_of == lvl)
        kv = u.batch.kv_len[mine].astype(np.int64)
        levels.append(dict(level=lvl, groups=int(mine.size), shared_groups=int((u.batch.qo_len[mine] > 1).sum()),
                           query_rows=int(u.batch.qo_len[mine].sum()), kv_tokens=int(kv.sum()),
                           pages=int(np.diff(u.batch.kv_indptr)[mine].sum()),
                           items=int(info.level_items[lvl]), prefill_items=int(info.level_prefill_items[lvl]),
                           kv_tokens_read=int(info.level_kv_tokens[lvl])))
    single = int((np.diff(kv_indptr).astype(np.int64) * a.page_size - a.page_size + last).sum())
    read = int(info.level_kv_tokens.sum())
    return dict(cascade=True, batch=B, heads=[hq, hk], group=g, head_dim=a.head_dim, page_size=a.page_size,
                shared_prefix=a.shared_prefix, groups=list(groups) if groups else None, num_levels=info.num_levels,
                tile_q=cp.planner.tile_q, rows=rows, num_ctas=cp.num_ctas, num_items=int(info.level_items.sum()),
                prefill=None if cp.prefill is None else dict(tile_q=cp.prefill.tile_q, rows=cp.prefill.tile.max_rows,
                                                             num_ctas=(info.prefill or cp.prefill).num_ctas),
                state_rows=info.num_state_rows, levels=levels, single_format_kv_tokens=single,
                cascade_kv_tokens_read=read, read_ratio=single / max(read, 1),
                plan_us=round(float(np.median(ts)) * 1e6, 2), plan_set_bytes=cp.planset.plan_bytes,
                plan_set=[dict(part=n, offset=o, bytes=b) for n, o, b in cp.planset.table()])


def render_cascade(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console()
    pf = r["prefill"]
    con.rule(f"[bold]rtattn cascade plan[/] · {r['num_levels']} levels · "
             + ("decode + prefill kernel families" if pf else "decode kernel family"))
    con.print(f"batch {r['batch']}  heads {r['heads'][0]}/{r['heads'][1]} (g={r['group']})  D={r['head_dim']}  "
              f"page {r['page_size']}  shared prefix {r['shared_prefix']} tokens"
              + (f", {r['groups'][0]} groups x {r['groups'][1]} tokens" if r["groups"] else ""))
    con.print(f"decode tile {r['tile_q']} queries ({r['rows']} rows), {r['num_ctas']} CTAs x {r['heads'][1]} KV heads"
              + (f"; prefill tile {pf['tile_q']} queries ({pf['rows']} rows), {pf['num_ctas']} CTAs x "
                 f"{r['heads'][1]} KV heads, for groups of more than {r['tile_q']} queries" if pf else ""))
    con.print(f"{r['num_items']} work items; {r['state_rows']} state rows folded; plan {r['plan_us']:.1f} µs (host)")
    t = Table(title="levels (what each reads; KV tokens per KV head)", title_justify="left")
    for col in ("level", "groups", "shared groups", "query rows", "KV tokens", "pages", "items", "on prefill",
                "KV tokens read"):
        t.add_column(col, justify="right")
    for lv in r["levels"]:
        t.add_row(*(str(lv[k]) for k in ("level", "groups", "shared_groups", "query_rows", "kv_tokens", "pages",
                                         "items", "prefill_items", "kv_tokens_read")))
    con.print(t)
    con.print(f"single format reads {r['single_format_kv_tokens']} KV tokens, the cascade "
              f"{r['cascade_kv_tokens_read']}: {r['read_ratio']:.2f}x fewer")
    ps = Table(title=f"plan set (one pinned buffer, one copy: {r['plan_set_bytes']} bytes)", title_justify="left")
    for col in ("part", "offset", "bytes"):
        ps.add_column(col, justify="left" if col == "part" else "right")
    for p in r["plan_set"]:
        ps.add_row(p["part"], str(p["offset"]), str(p["bytes"]))
    con.print(ps)
