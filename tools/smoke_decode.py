"""Small isolated first check of the decode kernels on a GPU: one case per variant and shape
family, printing the error against the float64 reference and a rough time, one line each.
Run it before the full GPU tier: a faulting kernel then costs one short process, not the tier."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _variant(c: dict, num_qo_heads: int):
    """(run params, reference Variant) of a smoke case."""
    import torch
    from rtattn.plan.reference import Variant
    v = c.get("variant", "plain")
    window = c.get("window", -1)
    if v == "soft_cap":
        return {"soft_cap": 30.0}, Variant(logits_soft_cap=30.0)
    if "sinks" in v:
        sinks = np.linspace(-2.0, 4.0, num_qo_heads)
        return {"sinks": torch.tensor(sinks, dtype=torch.float32, device="cuda")}, Variant(window_left=window, sinks=sinks)
    return None, Variant(window_left=window)


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two small cases, no timing (for compute-sanitizer)")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
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
        out = torch.empty_like(case.q)
        s = torch.cuda.Stream()
        launch = w.prepare(case.q, case.k_cache, case.v_cache, out=out, stream=s)
        with torch.cuda.stream(s):
            for _ in range(5):
                launch()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record(s)
            n = 50
            for _ in range(n):
                launch()
            ev[1].record(s)
        s.synchronize()
        us = ev[0].elapsed_time(ev[1]) * 1e3 / n
        nbytes = batch * kvlen * heads[1] * 128 * 2 * 2 + 2 * batch * heads[0] * 128 * 2
        print(f"time {batch}x{kvlen} {heads[0]}/{heads[1]}: {us:.1f} us  {nbytes/us/1e6:.2f} TB/s (L2-warm, eager)",
              flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
