"""rtattn-inspect: show the plan the inspector makes for a workload.

    rtattn-inspect                       # embedded synthetic workload (64 decode reqs)
    rtattn-inspect --batch 32 --kv-dist uniform:4096:16384 --heads 32/8
    rtattn-inspect --lengths lens.npz --mode batch-invariant --json
    rtattn-inspect --kv-dist const:32768 --window 4096   # a sliding window: read only the window

Host only: an H200 plan can be made on a laptop (--device names a description).
Bad arguments or inputs: one line on stderr, exit status 2 (rtattn.cli).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from rtattn.cli import CliError, Parser, run
from rtattn.plan.fields import MODES

# The embedded workload: a serving-shaped decode step (heavy-tailed contexts).
DEFAULT = dict(batch=64, kv_dist="zipf:1024", qo_len=1, heads="32/8", head_dim=128,
               page_size=16, device="h200", mode="auto", seed=0)
MAX_KV = 32768


def parse_dist(spec: str, batch: int, rng: np.random.Generator) -> np.ndarray:
    """const:N | uniform:A:B | zipf:MEAN (Pareto(1.5) tail, mean ~MEAN, <= 32K)."""
    kind, _, rest = spec.partition(":")
    try:
        args = [int(x) for x in rest.split(":")] if rest else []
    except ValueError:
        raise CliError(f"--kv-dist {spec!r}: arguments must be integers") from None
    if any(x < 0 for x in args):
        raise CliError(f"--kv-dist {spec!r}: lengths must be >= 0")
    if kind == "const" and len(args) == 1:
        return np.full(batch, args[0], dtype=np.int64)
    if kind == "uniform" and len(args) == 2 and args[0] <= args[1]:
        return rng.integers(args[0], args[1] + 1, batch)
    if kind == "zipf" and len(args) == 1 and args[0] >= 1:
        x = rng.pareto(1.5, batch) + 1.0          # mean 3, infinite variance
        return np.clip(np.rint(x * args[0] / 3.0), 1, MAX_KV).astype(np.int64)
    raise CliError(f"--kv-dist {spec!r}: expected const:N, uniform:A:B (A <= B) or zipf:MEAN (MEAN >= 1)")


def _lengths(where: str, values) -> np.ndarray:
    """A 1-D list of non-negative integers (floats are refused, not truncated)."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0:
        raise CliError(f"{where}: expected a non-empty list of lengths")
    if arr.dtype.kind not in "iu":
        raise CliError(f"{where}: lengths must be integers, got {arr.dtype} values such as {arr[0]!r}")
    if arr.min() < 0:
        raise CliError(f"{where}[{int(np.argmin(arr))}] = {arr.min()}: lengths must be >= 0")
    return arr.astype(np.int64)


def load_lengths(path: str):
    """JSON list of KV lengths (or {"kv_lens": [...], "qo_lens": [...]}), or NPZ
    with kv_lens and optional qo_lens."""
    try:
        if path.endswith(".npz"):
            with np.load(path) as z:
                d = {k: z[k] for k in z.files}
        else:
            with open(path) as f:
                d = json.load(f)
    except (OSError, ValueError, EOFError) as e:   # missing file, bad JSON / NPZ
        raise CliError(f"--lengths {path}: cannot read it ({type(e).__name__}: {e})") from None
    except Exception as e:   # noqa: BLE001  (zipfile errors and the like: still one line)
        raise CliError(f"--lengths {path}: not a JSON list or NPZ ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        return _lengths(f"{path}", d), None
    if "kv_lens" not in d:
        raise CliError(f"--lengths {path}: needs 'kv_lens' (and optionally 'qo_lens'), has {sorted(d)}")
    kv = _lengths(f"{path}: kv_lens", d["kv_lens"])
    qo = _lengths(f"{path}: qo_lens", d["qo_lens"]) if "qo_lens" in d else None
    if qo is not None and qo.shape != kv.shape:
        raise CliError(f"{path}: qo_lens has {qo.shape[0]} entries, kv_lens {kv.shape[0]}")
    return kv, qo


def build_parser() -> Parser:
    d = DEFAULT
    ap = Parser(prog="rtattn-inspect", description=(
        "Show the plan the inspector makes for one step of a workload (host only, no GPU). "
        "Without --lengths the workload is SYNTHETIC: --batch requests with KV lengths drawn "
        "from --kv-dist (default: 64 decode requests, heavy-tailed zipf lengths, mean ~1024)."))
    ap.add_argument("--batch", type=int, default=d["batch"], help="requests (synthetic workload)")
    ap.add_argument("--kv-dist", default=d["kv_dist"],
                    help="KV lengths (synthetic workload): const:N | uniform:A:B | zipf:MEAN")
    ap.add_argument("--qo-len", type=int, default=d["qo_len"], help="query tokens per request")
    ap.add_argument("--heads", default=d["heads"], help="H_qo/H_kv")
    ap.add_argument("--head-dim", type=int, default=d["head_dim"], help="64, 128 or 256")
    ap.add_argument("--page-size", type=int, default=d["page_size"], help="a power of two")
    ap.add_argument("--device", default=d["device"], choices=["h200", "h100", "a100"],
                    help="device description to plan for")
    ap.add_argument("--lengths", help="real workload instead: JSON list of KV lengths, or JSON/NPZ "
                    "with kv_lens and optional qo_lens")
    ap.add_argument("--mode", default=d["mode"], choices=list(MODES), help="planner mode")
    ap.add_argument("--chunk-tokens", type=int, default=None,
                    help="batch-invariant chunk (default: from the device and the heads)")
    ap.add_argument("--causal", action="store_true", help="clip tiles to the causal horizon")
    ap.add_argument("--window", type=int, default=None, metavar="N",
                    help="sliding window (window_left = N): tiles read only the KV their rows see")
    ap.add_argument("--kernel", default=None, choices=["decode", "prefill"],
                    help="kernel family (default: the one rtattn.families.choice predicts faster); with "
                         "--shared-prefix, decode puts every cascade level on decode (default: as CascadeWrapper)")
    ap.add_argument("--seed", type=int, default=d["seed"])
    ap.add_argument("--reps", type=int, default=200, help="plan() runs timed (median)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--shared-prefix", type=int, default=None, metavar="TOKENS",
                    help="cascade: every request starts with this shared prefix (--kv-dist: its own tokens)")
    ap.add_argument("--groups", default=None, metavar="G:T", help="cascade: G groups sharing T more tokens each")
    ap.add_argument("--levels", type=int, default=3, help="cascade: at most this many levels")
    return ap


def analyze(a) -> dict:
    if a.shared_prefix is not None:   # the cascade view (rtattn.cli.cascade_view)
        from .cascade_view import analyze_cascade
        hq, hk = (int(x) for x in a.heads.split("/"))
        return analyze_cascade(a, parse_dist(a.kv_dist, a.batch, np.random.default_rng(a.seed)), hq, hk)
    from rtattn.families.choice import choose_family
    from rtattn.plan.inspector import Planner
    from rtattn.plan.layout import check_config, indptr_from_lengths, paged_kv
    from rtattn.plan.verify import verify_plan

    rng = np.random.default_rng(a.seed)
    if a.qo_len < 1:
        raise CliError(f"--qo-len must be >= 1, got {a.qo_len}")
    if a.lengths:
        kv, qo = load_lengths(a.lengths)
        qo = qo if qo is not None else np.full(kv.shape[0], a.qo_len, np.int64)
        workload = f"from {a.lengths}"
    else:
        if a.batch < 1:
            raise CliError(f"--batch must be >= 1, got {a.batch}")
        kv = parse_dist(a.kv_dist, a.batch, rng)
        qo = np.full(a.batch, a.qo_len, np.int64)
        workload = f"synthetic: {a.batch} requests, KV {a.kv_dist}, seed {a.seed}"
    if a.causal:
        kv = np.maximum(kv, qo)
    try:
        hq, hk = (int(x) for x in a.heads.split("/"))
    except ValueError:
        raise CliError(f"--heads {a.heads!r}: expected H_qo/H_kv, e.g. 32/8") from None
    g = check_config(hq, hk, a.head_dim, a.page_size)   # before paged_kv divides by the page size
    choice = choose_family(hq, hk, a.head_dim, int(qo.max()), float(kv.mean()), len(kv),
                           family=a.kernel or "auto", device=a.device)
    kernel = choice.family
    kvp, idx, last = paged_kv(kv, a.page_size, shuffle_seed=a.seed)
    qi = indptr_from_lengths(qo)
    common = dict(max_batch=len(kv), max_qo_tokens=max(1, int(qo.sum())), max_pages=max(1, int(kvp[-1])),
                  num_qo_heads=hq, num_kv_heads=hk, head_dim=a.head_dim,
                  page_size=a.page_size, device=a.device, causal=a.causal, kernel=kernel,
                  max_rows=choice.rows[kernel], max_qo_len=max(1, int(qo.max())))
    p = Planner(mode=a.mode, chunk_tokens=a.chunk_tokens, **common)
    args = (qi, kvp, idx, last)
    buf = p.layout.allocate()
    info = p.plan(*args, out=buf, window_left=a.window)
    ts = []
    for _ in range(max(1, a.reps)):
        t = time.perf_counter()
        p.plan(*args, out=buf, window_left=a.window)
        ts.append(time.perf_counter() - t)
    verify_plan(info.views, qo, kv, tile_q=p.tile_q, page_size=a.page_size, causal=a.causal,
                window_left=a.window)
    naive = Planner(mode="naive", **common).plan(*args, window_left=a.window)
    loads = info.cta_loads
    full_kv = int((-(-qo // p.tile_q) * kv).sum())   # every tile over its request's whole KV
    return dict(
        mode=a.mode, mode_used=info.mode, workload=workload, device=a.device, kernel=kernel,
        family_choice=str(choice),
        batch=int(len(kv)),
        heads=[hq, hk], group=g, head_dim=a.head_dim, page_size=a.page_size,
        kv_total=int(kv.sum()), kv_max=int(kv.max()), qo_total=int(qo.sum()),
        window_left=a.window, planned_kv_tokens=info.planned_kv_tokens,
        num_ctas=p.num_ctas, grid=[p.num_ctas, hk],
        tile={"q": p.tile_q, "kv": p.tile.tile_kv, "rows": p.tile_q * g,
              "max_rows": p.tile.max_rows, "stages": p.tile.stages,
              "smem_bytes": p.tile.smem_bytes, "ctas_per_sm": p.tile.ctas_per_sm},
        chunk_tokens=info.chunk_tokens, num_items=info.num_items,
        unmasked_kv_tokens=full_kv,
        split_tiles=info.num_split_tiles, partial_slots=info.num_partial_rows,
        partial_slots_capacity=p.bounds.max_partial_rows, merge_rows=info.num_merge_rows,
        workspace_bytes=p.workspace_bytes(), plan_bytes=p.layout.plan_bytes,
        plan_us=round(float(np.median(ts)) * 1e6, 2),
        cta_loads=[int(x) for x in loads], max_load=int(loads.max()),
        mean_load=float(loads.mean()), naive_max_load=naive.max_load,
        naive_cta_loads=[int(x) for x in naive.cta_loads],
        imbalance=float(loads.max() / loads.mean()) if loads.mean() else 1.0,
        speedup_vs_naive=float(naive.max_load / loads.max()) if loads.max() else 1.0,
        fields=[dict(name=n, dtype=dt, capacity=c, offset=o, formula=f)
                for n, dt, c, o, f in p.layout.table()],
    )


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def render(r: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    t = r["tile"]
    mode = r["mode"] if r["mode"] == r["mode_used"] else f"{r['mode']} → {r['mode_used']}"
    con.rule(f"[bold]rtattn plan[/] · {mode} · {r['device']} · {r['kernel']} kernel")
    con.print(f"workload {r['workload']}")
    if r["mode"] == "auto":
        con.print(f"mode auto chose {r['mode_used']}")
    con.print(f"family {escape(r['family_choice'])}")
    con.print(f"batch {r['batch']}  query tokens {r['qo_total']}  KV tokens {r['kv_total']} "
              f"(max {r['kv_max']})  heads {r['heads'][0]}/{r['heads'][1]} (g={r['group']})  "
              f"D={r['head_dim']}  page {r['page_size']}")
    s = Table(show_header=False, box=None, padding=(0, 2))
    s.add_row("tile", f"T_q {t['q']} tokens = {t['rows']} rows (max {t['max_rows']}), T_kv "
              f"{t['kv']}, {t['stages']} stages, {_bytes(t['smem_bytes'])} smem, "
              f"{t['ctas_per_sm']} CTA/SM")
    s.add_row("grid", f"{r['num_ctas']} CTAs x {r['grid'][1]} KV heads (fixed)")
    window = "" if r["window_left"] is None else f" (window_left {r['window_left']})"
    s.add_row("KV read", f"{r['planned_kv_tokens']} of {r['kv_total']} tokens per KV head{window}")
    s.add_row("work items", f"{r['num_items']}  (KV chunk bound {r['chunk_tokens']} tokens)")
    s.add_row("splits", f"{r['split_tiles']} tiles split, {r['merge_rows']} merge rows")
    skipped = 1 - r["planned_kv_tokens"] / max(1, r["unmasked_kv_tokens"])
    s.add_row("mask skip", f"{r['planned_kv_tokens']} tile-tokens planned of {r['unmasked_kv_tokens']} "
              f"unmasked ({100 * skipped:.0f}% skipped: blocks the mask hides are never loaded)")
    s.add_row("partial slots", f"{r['partial_slots']} of {r['partial_slots_capacity']}")
    s.add_row("plan bytes", f"{r['plan_bytes']} ({_bytes(r['plan_bytes'])})")
    s.add_row("workspace", f"{r['workspace_bytes']} ({_bytes(r['workspace_bytes'])})")
    s.add_row("plan time", f"{r['plan_us']:.1f} µs (median, host)")
    s.add_row("max CTA load", f"{r['max_load']} vs naive {r['naive_max_load']}  -> "
              f"{r['speedup_vs_naive']:.2f}x lower; imbalance max/mean {r['imbalance']:.3f}")
    con.print(s)
    # Per-CTA load bars (bucketed when there are many CTAs).
    loads = np.asarray(r["cta_loads"], dtype=np.float64)
    nl = np.asarray(r["naive_cta_loads"], dtype=np.float64)
    per = max(1, -(-len(loads) // 48))
    top = max(loads.max(), nl.max(), 1.0)
    label_w = len(f"{len(loads) - 1}-{len(loads) - 1}") if per > 1 else len(str(len(loads) - 1))
    load_w = len(str(int(max(loads.max(), 0))))
    # two bar columns share what the CTA and load columns and the padding (1 per side) leave
    width = max(4, min(40, (con.width - max(3, label_w) - max(4, load_w) - 8) // 2))
    bars = Table(title="per-CTA load (cost units: 1 = one KV token)", box=None,
                 padding=(0, 1), title_justify="left")
    bars.add_column("CTA", justify="right")
    bars.add_column("load", justify="right")
    bars.add_column(f"plan ({r['mode']})", no_wrap=True)
    bars.add_column("naive", no_wrap=True)
    for i in range(0, len(loads), per):
        lv, nv = loads[i:i + per].max(), nl[i:i + per].max()
        label = str(i) if per == 1 else f"{i}-{min(len(loads), i + per) - 1}"
        bars.add_row(label, f"{int(lv)}", "[green]" + "█" * max(0, round(width * lv / top)),
                     "[red]" + "█" * max(0, round(width * nv / top)))
    con.print(bars)
    ft = Table(title="plan fields (rtattn.plan.fields.PLAN_FIELDS)", title_justify="left")
    for col in ("name", "dtype", "capacity", "offset", "formula"):
        ft.add_column(col, justify="right" if col in ("capacity", "offset") else "left")
    for f in r["fields"]:
        ft.add_row(f["name"], f["dtype"], str(f["capacity"]), str(f["offset"]), f["formula"])
    con.print(ft)


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    r = analyze(a)
    if a.json:
        print(json.dumps(r))
    elif r.get("cascade"):
        from .cascade_view import render_cascade
        render_cascade(r)
    else:
        render(r)
    return 0


def main(argv=None) -> int:
    return run("rtattn-inspect", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
