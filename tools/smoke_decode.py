"""Small isolated first check of the decode kernels on a GPU: one case per variant and shape
family, printing the error against the float64 reference and a rough time, one line each.
Run it before the full GPU tier: a faulting kernel then costs one short process, not the tier.
--invariant: the batch-invariant cases (tests/decode_cases.INVARIANT_CASES), one process each."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _variant(c: dict, num_qo_heads: int):
    """(run params, reference Variant) of a smoke case."""
    from decode_cases import variant_inputs
    return variant_inputs(c.get("variant", "plain"), num_qo_heads, c.get("window", -1))


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two small cases, no timing (for compute-sanitizer)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="fp8 KV caches instead (e4m3, e5m2, the sm_80 path)")
    ap.add_argument("--fp8-case", nargs=2, metavar=("KV", "D"), help=argparse.SUPPRESS)
    ap.add_argument("--invariant", action="store_true",
                    help="batch-invariant mode: every decode_cases.INVARIANT_CASES entry in its own process")
    ap.add_argument("--invariant-case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.invariant_case:
        return invariant_case_line(args.invariant_case)
    if args.invariant:
        from decode_cases import INVARIANT_CASES
        return 1 if each_in_a_process([(["--invariant-case", name], {}) for name in INVARIANT_CASES], jobs=8) else 0
    if args.fp8_case:
        return fp8_case_line(args.fp8_case[0], int(args.fp8_case[1]))
    if args.fp8:
        return smoke_fp8(args.no_timing)
    import torch
    from decode_cases import lse_error, make_case, rel_error
    from test_decode import _run

    fails = 0
    cases = [("plain 32/8 d128 p16", dict(kv=[1, 17, 1024, 3000], heads=(32, 8), d=128, ps=16)),
             ("plain 32/32 d128 p1", dict(kv=[5, 300, 2000], heads=(32, 32), d=128, ps=1)),
             ("plain 32/4 d64 p16", dict(kv=[64, 65, 1000], heads=(32, 4), d=64, ps=16)),
             ("plain 16/2 d256 p16", dict(kv=[100, 2500], heads=(16, 2), d=256, ps=16)),
             ("plain 32/1 d128 p16 (g=32)", dict(kv=[100, 2500], heads=(32, 1), d=128, ps=16)),
             ("soft_cap 32/8 d256 p16", dict(kv=[100, 2500], heads=(32, 8), d=256, ps=16, variant="soft_cap")),
             ("window 1000 32/8 p16 (split)", dict(kv=[9000, 30], heads=(32, 8), d=128, ps=16,
                                                   variant="sliding_window", window=1000)),
             ("sinks 32/2 p16 (split, g=16)", dict(kv=[9000, 30, 0], heads=(32, 2), d=128, ps=16, variant="sinks")),
             ("window 127 + sinks 32/1 p1 (g=32)", dict(kv=[5000, 70], heads=(32, 1), d=128, ps=1,
                                                        variant="sliding_window_sinks", window=127))]
    if args.quick:
        cases = [("split+merge 8/2 d128 p16", dict(kv=[3, 700, 2100], heads=(8, 2), d=128, ps=16)),
                 ("g=8 d64 p1", dict(kv=[40, 900], heads=(8, 1), d=64, ps=1))]
    for name, c in cases:
        try:
            case = make_case(c["kv"], *c["heads"], c["d"], c["ps"], seed=1)
            params, var = _variant(c, case.q.shape[1])
            t = time.perf_counter()
            o, lse, w = _run(case, variant=c.get("variant", "plain"), params=params, window_left=c.get("window"))
            dt = time.perf_counter() - t
            want_o, want_lse = case.reference(var)
            e, le = rel_error(o, want_o), lse_error(lse, want_lse)
            ok = e < 2e-2 and le < 2e-2
            fails += not ok
            print(f"{'ok ' if ok else 'BAD'} {name:32s} O err {e:.2e}  LSE err {le:.2e}  "
                  f"ctas={w.num_ctas} ctas/SM={w.kernels.ctas_per_sm} regs={w.kernels.decode.attributes()['num_regs']} "
                  f"first call {dt*1e3:.0f} ms", flush=True)
        except Exception as ex:  # keep going: report every family
            fails += 1
            print(f"ERR {name}: {type(ex).__name__}: {ex}", flush=True)
            if "CUDA_ERROR_ILLEGAL" in str(ex) or "LAUNCH_FAILED" in str(ex):
                return 2
    if args.quick or args.no_timing:
        return 1 if fails else 0
    # rough timing, no peer: 16 x 1024 at 32/8 and 32/4, 256 x 4096 at 32/8
    from decode_cases import make_case as mk
    for batch, kvlen, heads in [(16, 1024, (32, 8)), (16, 1024, (32, 4)), (64, 4096, (32, 8)), (256, 4096, (32, 8))]:
        case = mk([kvlen] * batch, *heads, 128, 16, seed=2)
        _, _, w = _run(case, lse=False)
        us = time_eager(w, case, 50)
        nbytes = batch * kvlen * heads[1] * 128 * 2 * 2 + 2 * batch * heads[0] * 128 * 2
        print(f"time {batch}x{kvlen} {heads[0]}/{heads[1]}: {us:.1f} us  {nbytes/us/1e6:.2f} TB/s (L2-warm, eager)",
              flush=True)
    return 1 if fails else 0


FP8_CASES = [(kv, d, defines) for kv in ("float8_e4m3fn", "float8_e5m2")
             for d, defines in ((128, ""), (64, ""), (256, ""), (128, "-DRTATTN_FP8_SOFTWARE"),
                                (128, "-DRTATTN_FP8_CVT_H1"))]


def fp8_case_line(kv: str, d: int) -> int:
    """One fp8 case in this process (built with $RTATTN_DEV_DEFINES): one line, exit 0 if correct."""
    import os
    defines = os.environ.get("RTATTN_DEV_DEFINES", "")
    from decode_cases import fp8_case, lse_error, make_case, rel_error
    from test_fp8_kv import _run
    name = f"{kv} d{d} {defines or '(default)'}"
    try:
        case, ks, vs = fp8_case(make_case([3, 700, 2100], 32, 8, d, 16, seed=1), kv, "head", seed=1)
        o, lse, w = _run(case, kv, ks, vs)
        want_o, want_lse = case.reference()
        e, le = rel_error(o, want_o), lse_error(lse, want_lse)
        ok = e < 5e-3 and le < 2e-3
        print(f"{'ok ' if ok else 'BAD'} {name:44s} O err {e:.2e}  LSE err {le:.2e}  "
              f"regs={w.kernels.decode.attributes()['num_regs']} ctas/SM={w.kernels.ctas_per_sm}", flush=True)
        return 0 if ok else 1
    except Exception as ex:  # noqa: BLE001 -- one line per case
        print(f"ERR {name}: {type(ex).__name__}: {str(ex).splitlines()[0][:160]}", flush=True)
        return 2


def invariant_case_line(name: str) -> int:
    """One batch-invariant case in this process: error against float64, request 0's bits alone /
    with short companions / with all, one line, exit 0 if correct and bitwise invariant."""
    from decode_cases import INVARIANT_CASES, check_invariant_case
    try:
        r = check_invariant_case(INVARIANT_CASES[name])
        ok = r["o_err"] < 2e-2 and r["lse_err"] < 2e-2 and r["bitwise"] and r["splits"] > 1
        print(f"{'ok ' if ok else 'BAD'} inv {name:30s} O err {r['o_err']:.2e}  LSE err {r['lse_err']:.2e}  "
              f"bitwise={r['bitwise']} splits={r['splits']} C={r['chunk']} regs={r['regs']} "
              f"ctas/SM={r['ctas_per_sm']}", flush=True)
        return 0 if ok else 1
    except Exception as ex:  # noqa: BLE001 -- one line per case
        print(f"ERR inv {name}: {type(ex).__name__}: {str(ex).splitlines()[0][:160]}", flush=True)
        return 2


def each_in_a_process(cases, jobs: int = 4) -> int:
    """Run this script once per (arguments, extra environment) case, `jobs` at a time, so a
    faulting kernel cannot hide the others; print each child's result line in order. Returns the
    number of failures."""
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def child(case):
        args, env = case
        try:
            r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=120,
                               env={**os.environ, **env})
        except subprocess.TimeoutExpired:
            return 1, f"ERR {args}: timed out"
        lines = [ln for ln in r.stdout.splitlines() if ln[:3] in ("ok ", "BAD", "ERR")]
        return r.returncode, lines[-1] if lines else f"ERR {args}: no result ({(r.stderr or '').strip()[-160:]})"

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(child, cases))
    for _, line in results:
        print(line, flush=True)
    return sum(rc != 0 for rc, _ in results)


def smoke_fp8(no_timing: bool) -> int:
    """Each fp8 case (format x head dim x conversion path) in its own process, so a faulting
    kernel cannot hide the others; then a rough 256 x 4096 time."""
    fails = each_in_a_process([(["--fp8-case", kv, str(d)], {"RTATTN_DEV_DEFINES": dfs}) for kv, d, dfs in FP8_CASES])
    if no_timing:
        return 1 if fails else 0
    import torch
    from decode_cases import make_case
    from test_fp8_kv import _run
    for kv in ("bfloat16", "float8_e4m3fn"):
        case = make_case([4096] * 256, 32, 8, 128, 16, seed=2)
        if kv != "bfloat16":   # N(0,1) rounded to fp8 (fp8_case's float64 reference would be 16 GB)
            case.k_cache, case.v_cache = (t.to(getattr(torch, kv)) for t in (case.k_cache, case.v_cache))
        _, _, w = _run(case, kv, None, None) if kv != "bfloat16" else _run_bf16(case)
        us = time_eager(w, case, 20)
        nbytes = 256 * 4096 * 8 * 128 * 2 * (1 if kv != "bfloat16" else 2) + 2 * 256 * 32 * 128 * 2
        print(f"time 256x4096 32/8 {kv}: {us:.1f} us  {nbytes / us / 1e6:.2f} TB/s (eager)", flush=True)
    return 1 if fails else 0


def time_eager(w, case, n: int) -> float:
    """µs per eager launch of `w` on `case` (L2-warm: the same inputs every time)."""
    import torch
    out = torch.empty_like(case.q)
    s = torch.cuda.Stream()
    launch = w.prepare(case.q, case.k_cache, case.v_cache, out=out, stream=s)
    with torch.cuda.stream(s):
        for _ in range(3):
            launch()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record(s)
        for _ in range(n):
            launch()
        ev[1].record(s)
    s.synchronize()
    return ev[0].elapsed_time(ev[1]) * 1e3 / n


def _run_bf16(case):
    from test_decode import _run
    return _run(case, lse=False)


if __name__ == "__main__":
    sys.exit(main())
