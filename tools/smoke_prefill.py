"""Isolated first check of the prefill kernel on a GPU: a few shapes against the float64
reference, each case reported (error or exception) without stopping, so one bad case does not
hide the others. Run before the GPU tier:
python tools/smoke_prefill.py [--mma sync|wgmma|ws] [--cross] [--tile TAG] [case ...]
(--mma forces the kernel for every case; by default the family picks, and each line names the tile;
--cross: the KV stream across items, tile cross=True (with --mma sync too), on every case whose tile
has it; the others are skipped, naming why; --tile: bench_prefill's tile tag on every case, e.g.
wg_q128_pp (the policy refusing a case's shape skips it, naming why))."""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from prefill_cases import TOL, combo_spec, errors, make_case, run_prefill, variant_args  # noqa: E402

CASES = [  # (name, kv_lens, qo_lens, heads, head_dim, page, variant, dtype, extra)
    ("causal square 32/8", [300, 1024, 77], None, (32, 8), 128, 16, "causal", "bfloat16", {}),
    ("plain cached prefix", [500, 1500], [100, 700], (32, 8), 128, 16, "plain", "bfloat16", {}),
    ("causal cached prefix", [513, 1500, 64], [1, 700, 64], (32, 8), 128, 16, "causal", "bfloat16", {}),
    ("d64 fp16", [700, 129], None, (16, 4), 64, 16, "causal", "float16", {}),
    ("d256", [700, 129], None, (16, 4), 256, 16, "causal", "bfloat16", {}),
    ("page 1", [333, 40], None, (32, 8), 128, 1, "causal", "bfloat16", {}),
    ("page 128", [333, 1040], None, (32, 8), 128, 128, "causal", "bfloat16", {}),
    ("ragged kv", [333, 40, 600], [100, 40, 1], (32, 8), 128, 1, "causal", "bfloat16", {"ragged": True}),
    ("g=1", [400, 90], None, (8, 8), 128, 16, "causal", "bfloat16", {}),
    ("g=16", [400, 90], None, (32, 2), 128, 16, "causal", "bfloat16", {}),
    ("split kv (few ctas)", [3000, 200], [3000, 10], (8, 2), 128, 16, "causal", "bfloat16", {"num_ctas": 3}),
    ("rows 16 multi-token", [1000, 2000], [4, 4], (32, 8), 128, 16, "causal", "bfloat16", {"avg_qo_len": 4}),
    ("window", [900, 300], None, (16, 4), 128, 16, "sliding_window", "bfloat16", {}),
    ("soft_cap", [900, 300], None, (16, 4), 128, 16, "soft_cap", "bfloat16", {}),
    ("alibi", [900, 300], None, (16, 4), 128, 16, "alibi", "bfloat16", {}),
    ("sigmoid", [900, 300], None, (16, 4), 128, 16, "sigmoid", "bfloat16", {}),
    ("rope", [900, 300], [300, 300], (16, 4), 128, 16, "rope", "bfloat16", {}),
    ("custom_mask", [200, 300], [50, 300], (16, 4), 128, 16, "custom_mask", "bfloat16", {}),
    ("HND", [700, 129], None, (16, 4), 128, 16, "causal", "bfloat16", {"kv_layout": "HND"}),
    ("d64 bf16", [700, 129], None, (16, 4), 64, 16, "causal", "bfloat16", {}),
    ("d128 fp16", [700, 129], None, (16, 4), 128, 16, "causal", "float16", {}),
    ("d64 fp16 2 stages", [700, 129], None, (16, 4), 64, 16, "causal", "float16", {"tile": {"stages": 2}}),
    ("d128 3 stages kv32", [700, 129], None, (16, 4), 128, 16, "causal", "bfloat16",
     {"tile": {"stages": 3, "tile_kv": 32}}),
    ("sinks (split rows too)", [2000, 300], [64, 300], (16, 4), 128, 16, "sinks", "bfloat16", {"num_ctas": 5}),
    # the bench's variant rows (causal with the variant): linear bias in the accumulators, folded caps
    ("causal alibi g=16", [900, 300, 1500], [900, 100, 37], (32, 2), 128, 16, "causal+alibi", "bfloat16", {}),
    ("causal soft_cap 32/8", [900, 300, 1500], [900, 100, 37], (32, 8), 128, 16, "causal+soft_cap", "bfloat16", {}),
    ("causal alibi+soft_cap g=3 fp16", [900, 300], [900, 64], (12, 4), 128, 16, "causal+alibi+soft_cap", "float16", {}),
    ("causal window 32/8 split", [3000, 1500], [3000, 700], (32, 8), 128, 16, "causal+sliding_window", "bfloat16",
     {"num_ctas": 7}),
]


def main(argv=None) -> int:
    """Every case, or only the cases whose index is given (one process per case keeps a faulting
    kernel from poisoning the others: `for i in $(seq 0 27); do python tools/smoke_prefill.py $i & done`,
    one per case of CASES)."""
    ap = argparse.ArgumentParser(description="the prefill kernel against float64 on CASES, case by case")
    ap.add_argument("--mma", choices=("sync", "wgmma", "ws"), help="this kernel for every case (default: the family's)")
    ap.add_argument("--cross", action="store_true", help="the KV stream across items (tile cross=True)")
    ap.add_argument("--tile", help="a bench_prefill tile tag on every case, e.g. wg_q128_pp or wg_q64_kv32_b3")
    ap.add_argument("case", type=int, nargs="*", help="indices into CASES (default: every case)")
    args = ap.parse_args(argv)
    forced = {}
    if args.tile:
        from bench_prefill import parse_tile
        forced = parse_tile(args.tile)
    # the tile fields every case gets (after its own): --mma, --cross, then --tile's
    overrides = {**({"mma": args.mma} if args.mma else {}), **({"cross": True} if args.cross else {}), **forced}
    cases = [c for i, c in enumerate(CASES) if not args.case or i in args.case]
    bad = skipped = 0
    for name, kv, qo, (H, Hk), D, ps, variant, dtype, extra in cases:
        extra = dict(extra)
        layout = extra.pop("kv_layout", "NHD")
        if overrides:
            extra["tile"] = {**extra.get("tile", {}), **overrides}
        rng = np.random.default_rng(len(name))
        qo = kv if qo is None else qo
        t0 = time.perf_counter()
        try:
            case = make_case(kv, H, Hk, D, ps, dtype=dtype, kv_layout=layout, qo_lens=qo, seed=len(name))
            params, var = variant_args(variant, H, qo, kv, rng)
            kernel_variant = combo_spec(variant, dtype, D) if "+" in variant else variant
            o, lse, w = run_prefill(case, kernel_variant, dtype, params, **extra)
            eo, el = errors(case, o, lse, var)
            ok = eo < TOL[dtype] and el < 2e-2
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {name:24s} O err {eo:.2e} LSE err {el:.2e} tile {w.tile.tag} "
                  f"items {w.info.num_items} merges {w.info.num_merge_rows} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:
            if isinstance(e, ValueError) and (forced or (args.cross and "cross=True" in str(e))):
                skipped += 1   # a tile the stream across items is not built for (the policy's refusal)
                print(f"--  {name:24s} skipped: {e}", flush=True)
            else:
                bad += 1
                print(f"EXC {name}:\n{traceback.format_exc()}", flush=True)
    print(f"{len(cases) - skipped - bad}/{len(cases) - skipped} cases ok" + (f" ({skipped} skipped)" if skipped else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
