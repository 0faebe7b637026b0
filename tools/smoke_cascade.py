"""Isolated first check of the cascade on a GPU (shared levels on the prefill kernel, suffixes on
decode, the fold as the last call of one launch list; the flat plan's decode and merge kernels; the
decode build that joins the prefix's states, join_levels; the wrapper's defaults): a few shapes
against the float64 reference, each case reported (error or exception) without stopping, so one
bad case does not hide the others. Run before the GPU tier, one process per case (a faulting
kernel poisons its process):

    for i in $(seq 0 23); do timeout 60 python tools/smoke_cascade.py $i & done; wait
    python tools/smoke_cascade.py --mma sync 0 3     # the shared levels on the other prefill kernel

`--mma` is the wrapper's prefill_mma (default "auto": the wgmma kernel on the H200).
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cascade_cases import (REF, TOL, gpu_case, gpu_errors, gpu_run, gpu_wrapper, one_prefix_batch,  # noqa: E402
                           shared_batch, unequal_suffix_batch)


def prefix40(rng, ps):      # 40 requests over a 256-token prefix: level 0 on one prefill tile
    return one_prefix_batch(40, 256, 40, ps)


def two_groups(rng, ps):    # a system prompt over groups of 12 and 9: both shared levels on prefill
    return shared_batch(rng, ps, groups=((12, 3), (9, 2)), system_pages=6, loners=1, suffix_pages=(2, 4))


def small_tree(rng, ps):    # a system prompt over groups of 6 and 5: both shared levels on one 64-row prefill tile
    return shared_batch(rng, ps, groups=((6, 3), (5, 2)), system_pages=6, loners=1, suffix_pages=(2, 4))


# (name, batch(rng, page_size), heads, head_dim, page, levels, variant, dtype, queries per request,
#  plan: a key of PLANS)
CASES = [
    ("prefill level, 40 x 256-token prefix", prefix40, (32, 8), 128, 16, 2, "plain", "bfloat16", 1, True),
    ("decode only (A/B)", prefix40, (32, 8), 128, 16, 2, "plain", "bfloat16", 1, False),
    ("64 x 8K prefix (bench shape)", lambda r, ps: one_prefix_batch(64, 8192, 128, ps), (32, 8), 128, 16, 2,
     "plain", "bfloat16", 1, True),
    ("tree, 3 levels", lambda r, ps: shared_batch(r, ps, groups=((70, 6), (40, 3)), system_pages=44, loners=3,
                                                  suffix_pages=(1, 3)), (32, 8), 128, 16, 3, "plain", "bfloat16", 1, True),
    ("g=1 d64 page 1", lambda r, ps: one_prefix_batch(48, 500, 30, ps), (32, 32), 64, 1, 2, "plain", "bfloat16", 1, True),
    ("g=32 page 64", lambda r, ps: one_prefix_batch(20, 1024, 100, ps), (32, 1), 128, 64, 2, "plain", "bfloat16", 1,
     True),
    ("d256 fp16", lambda r, ps: one_prefix_batch(40, 700, 60, ps), (8, 8), 256, 16, 2, "plain", "float16", 1, True),
    ("causal, 3 queries each", two_groups, (32, 8), 128, 16, 3, "causal", "bfloat16", 3, True),
    ("sliding window", two_groups, (32, 8), 128, 16, 3, "sliding_window", "bfloat16", 1, True),
    ("alibi", two_groups, (32, 8), 128, 16, 3, "alibi", "bfloat16", 3, True),
    ("soft-cap", prefix40, (32, 8), 128, 16, 2, "soft_cap", "bfloat16", 1, True),
    ("sigmoid", prefix40, (32, 8), 128, 16, 2, "sigmoid", "bfloat16", 1, True),
    ("flat plan, 16 x 1K prefix", lambda r, ps: one_prefix_batch(16, 1024, 128, ps), (32, 8), 128, 16, 2, "alibi",
     "bfloat16", 1, "flat"),
    ("joined levels, 64 x 8K prefix", lambda r, ps: one_prefix_batch(64, 8192, 128, ps), (32, 8), 128, 16, 2,
     "plain", "bfloat16", 1, "join"),
    ("joined levels, g=1 d64 page 1", lambda r, ps: one_prefix_batch(48, 500, 30, ps), (32, 32), 64, 1, 2,
     "causal", "bfloat16", 1, "join"),
    ("defaults, 64 x 8K prefix (joined)", lambda r, ps: one_prefix_batch(64, 8192, 128, ps), (32, 8), 128, 16, 2,
     "alibi", "bfloat16", 1, "auto-join"),
    ("defaults, 16 x 1K prefix (flat)", lambda r, ps: one_prefix_batch(16, 1024, 128, ps), (32, 8), 128, 16, 2,
     "plain", "bfloat16", 1, "auto-flat"),
    ("one prefill CTA per SM, 14 x 8K (joined)", lambda r, ps: one_prefix_batch(14, 8192, 128, ps), (32, 8), 128,
     16, 2, "causal", "bfloat16", 1, "join-ov1"),
    ("one prefill CTA per SM, tree (folded)", small_tree, (32, 8), 128, 16, 3, "alibi", "bfloat16", 1, "ov1"),
    ("joined levels, 14 x 8K (the narrow grid)", lambda r, ps: one_prefix_batch(14, 8192, 128, ps), (32, 8), 128,
     16, 2, "plain", "bfloat16", 1, "join"),
    # casc8: suffixes of unequal lengths (plan_union): the one-row-tile decode build ("prefill-q1", the default),
    # their join (join_uneven, unsplit), the partitioned grid with leave_early, flat="auto"
    ("one-query build, 32 x 2K, uneven suffixes", lambda r, ps: unequal_suffix_batch(32, 2048, ps, r, scale=16),
     (32, 4), 128, 16, 2, "alibi", "bfloat16", 1, True),
    ("joined uneven suffixes, 24 x 1K (unsplit)", lambda r, ps: unequal_suffix_batch(24, 1024, ps, r, scale=16),
     (32, 8), 128, 16, 2, "causal", "bfloat16", 1, "join-uneven"),
    ("leave early, 12 of 33 prefill CTAs", lambda r, ps: unequal_suffix_batch(32, 2048, ps, r, scale=16),
     (32, 4), 128, 16, 2, "plain", "bfloat16", 1, "le-part"),
    ("flat auto, 32 x 2K uneven, 28/4", lambda r, ps: unequal_suffix_batch(32, 2048, ps, r, scale=16),
     (28, 4), 128, 16, 2, "plain", "bfloat16", 1, "flat-auto"),
]
# plan -> (CascadeWrapper arguments, whether it puts work on prefill tiles, is flat, joins its levels)
PLANS = {True: (dict(prefill=True, join_levels=False), True, False, False),
         False: (dict(prefill=False), False, False, False),
         "flat": (dict(prefill=False, flat=True), False, True, False),
         "join": (dict(prefill=True, join_levels=True), True, False, True),
         "auto-join": (None, True, False, True),      # None: the wrapper's defaults (prefill="auto", join_levels=True)
         "auto-flat": (None, False, True, False),    # flat="auto" (the default) plans p1024x16-like steps flat
         # the shared level at one CTA per SM (prefill_ctas_per_sm=1): the decode level's CTAs beside it
         "join-ov1": (dict(prefill=True, join_levels=True, prefill_ctas_per_sm=1), True, False, True),
         "ov1": (dict(prefill=True, join_levels=False, prefill_ctas_per_sm=1), True, False, False),
         "join-uneven": (dict(prefill=True, join_levels=True, join_uneven=True, join_unsplit=True), True, False, True),
         "le-part": (dict(prefill=True, join_levels=False, prefill_ctas=12, leave_early=True), True, False, False),
         "flat-auto": (dict(prefill="auto", flat="auto", join_levels=True), False, True, False)}


def wrapper_kw(plan, mma: str = "auto") -> dict:
    """The CascadeWrapper arguments of a case's plan (PLANS), on the prefill kernel `mma`: for the
    defaults' plans, CascadeWrapper's own defaults of what gpu_wrapper would otherwise set for tests."""
    kw = PLANS[plan][0]
    if kw is None:
        import inspect
        from rtattn.cascade import CascadeWrapper
        own = inspect.signature(CascadeWrapper).parameters
        kw = {k: own[k].default for k in ("prefill", "flat", "join_levels")}
    return dict(kw, prefill_mma=mma)


def check(name, make, heads, D, ps, levels, variant, dtype, qo_len, plan, mma="auto") -> tuple[bool, str]:
    """Run one case into poisoned outputs; (passed, its report line)."""
    t0 = time.perf_counter()
    batch = make(np.random.default_rng(len(name)), ps)
    B = len(batch[0]) - 1
    c = gpu_case(batch, *heads, D, ps, dtype, qo=np.arange(B + 1) * qo_len, seed=len(name))
    _, on_prefill, flat, joined = PLANS[plan]
    w = gpu_wrapper(c, levels, variant, **wrapper_kw(plan, mma))
    eo, el = gpu_errors(c, *gpu_run(c, w, variant), REF[variant])
    ok = (eo < TOL[dtype] and el < 2e-2 and bool(w.info.level_prefill_items.any()) == on_prefill
          and w.info.flat == flat and w.info.joined == joined)
    kernel = w.prefill_tile.mma if w.prefill is not None else "-"
    return ok, (f"{'ok ' if ok else 'BAD'} {name:34s} O err {eo:.2e} LSE err {el:.2e} levels {w.info.num_levels} "
                f"prefill items {w.info.level_prefill_items.tolist()} of {w.info.level_items.tolist()} "
                f"[{w.launch_list()}, {kernel}] ({time.perf_counter() - t0:.1f} s)")


def main(argv=None) -> int:
    """Every case, or only the cases whose index is given; `--mma KERNEL` first: the shared
    levels' prefill kernel."""
    args = list(sys.argv[1:] if argv is None else argv)
    mma = "auto"
    if args[:1] == ["--mma"]:
        mma, args = args[1], args[2:]
    picked = [int(a) for a in args]
    passed = []
    for case in (c for i, c in enumerate(CASES) if not picked or i in picked):
        try:
            ok, line = check(*case, mma=mma)
        except Exception:
            ok, line = False, f"EXC {case[0]}:\n{traceback.format_exc()}"
        print(line, flush=True)
        passed.append(ok)
    print(f"{sum(passed)}/{len(passed)} cases ok")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
