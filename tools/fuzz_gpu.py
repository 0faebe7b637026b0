#!/usr/bin/env python3
"""Random workloads on the GPU against the float64 reference: shapes, groups, head dims, pages,
layouts, lengths and variants drawn from a seed, none of them the tests' own. Each case is one
wrapper call into poisoned outputs (decode, multi-token decode, prefill over paged or ragged KV,
cascade with shared prefixes), checked as the GPU tier checks (O relative error, LSE error).

    python tools/fuzz_gpu.py --seeds 0:100 [--budget-s 200] [--list]

One line per case (seed, what it drew, errors, PASS / FAIL / EXC); a faulting kernel ends the
process, so run seed ranges in separate processes (the last line names the seed it started).
--list prints the cases without a GPU. Exit 1 if any case failed.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FAMILIES = ("decode", "decode-mtd", "prefill", "prefill-ragged", "cascade")
DECODE_VARIANTS = ("plain", "soft_cap", "sinks", "sliding_window", "sliding_window_sinks", "sigmoid", "alibi")
PREFILL_VARIANTS = ("causal", "plain", "sliding_window", "soft_cap", "alibi", "sinks", "sigmoid", "rope",
                    "custom_mask", "causal+soft_cap", "causal+alibi", "causal+sliding_window")
CASCADE_VARIANTS = ("plain", "soft_cap", "alibi", "sigmoid")
TOL = {"bfloat16": 2e-2, "float16": 5e-3}
KV_TOKENS = 24_000   # per case: the float64 reference's cost


def _lengths(rng, batch: int, lo: int = 1) -> np.ndarray:
    """A skewed mix: mostly short or medium, now and then one long request."""
    kind = rng.choice(["short", "medium", "mixed", "one-long"])
    if kind == "short":
        n = rng.integers(lo, 65, batch)
    elif kind == "medium":
        n = rng.integers(max(lo, 100), 3001, batch)
    elif kind == "mixed":
        n = np.where(rng.random(batch) < 0.5, rng.integers(lo, 40, batch), rng.integers(500, 5000, batch))
    else:
        n = rng.integers(lo, 300, batch)
        n[rng.integers(batch)] = rng.integers(6000, 16385)
    n = np.maximum(n, lo)
    while n.sum() > KV_TOKENS:
        n = np.maximum(lo, n // 2)
    return n.astype(np.int64)


def draw(seed: int) -> dict:
    """The case of a seed (no GPU needed)."""
    rng = np.random.default_rng(seed)
    fam = FAMILIES[seed % len(FAMILIES)]
    hk = int(rng.choice([1, 2, 4, 8]))
    g = int(rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 16]))
    while hk * g > 64:
        hk //= 2
    d = int(rng.choice([64, 128, 128, 256]))
    dtype = str(rng.choice(["bfloat16", "float16"]))
    c = dict(seed=seed, family=fam, heads=(hk * g, hk), head_dim=d, dtype=dtype, layout="NHD")
    if fam == "prefill-ragged":
        c["page"] = 1
    else:
        c["page"] = int(rng.choice([1, 2, 4, 8, 16, 16, 32, 64, 128]))
    if fam in ("decode", "decode-mtd", "prefill") and rng.random() < 0.3:
        c["layout"] = "HND"
    batch = int(rng.integers(1, 25))
    if fam == "decode":
        c["variant"] = str(rng.choice(DECODE_VARIANTS))
        c["kv"] = _lengths(rng, batch)
        c["qo"] = np.ones(batch, np.int64)
    elif fam == "decode-mtd":   # causal multi-token decode (speculative verification), 2-16 tokens
        c["variant"] = "causal"
        c["kv"] = _lengths(rng, batch, lo=16)
        c["qo"] = rng.integers(2, 17, batch)
    elif fam.startswith("prefill"):
        c["variant"] = str(rng.choice(PREFILL_VARIANTS))
        kv = _lengths(rng, batch)
        frac = rng.choice([1.0, 1.0, 0.5, 0.1])   # whole prompts, or chunks over cached prefixes
        qo = np.maximum(1, (kv * frac).astype(np.int64))
        while qo.sum() > 6000:
            qo = np.maximum(1, qo // 2)
        qo = np.minimum(qo, kv)
        while (qo * kv).sum() * hk * g * d > 2e10:   # the float64 reference's products
            qo = np.maximum(1, qo // 2)
        c["kv"], c["qo"] = kv, qo
    else:
        c["variant"] = str(rng.choice(CASCADE_VARIANTS))
        c["prefix"] = int(rng.integers(1, 8193))
        c["batch"] = batch
        c["suffix"] = int(rng.integers(1, 300))
        c["mtd"] = int(rng.choice([1, 1, 4]))
    return c


def describe(c: dict) -> str:
    h = f"{c['heads'][0]}/{c['heads'][1]} d{c['head_dim']} p{c['page']} {c['layout']} {c['dtype']} {c['variant']}"
    if c["family"] == "cascade":
        return f"cascade {h} prefix {c['prefix']} x {c['batch']} suffix {c['suffix']} q{c['mtd']}"
    kv = c["kv"]
    return (f"{c['family']} {h} B={len(kv)} kv {int(kv.min())}-{int(kv.max())} (sum {int(kv.sum())}) "
            f"qo sum {int(c['qo'].sum())}")


def _decode(c, rng):
    import torch
    from decode_cases import make_case, variant_inputs
    from prefill_cases import variant_args
    from rtattn.plan import reference as ref
    from rtattn.wrapper import BatchDecodeWrapper
    H, Hk = c["heads"]
    case = make_case(c["kv"], H, Hk, c["head_dim"], c["page"], dtype=c["dtype"], kv_layout=c["layout"],
                     qo_lens=c["qo"], seed=c["seed"])
    v = c["variant"]
    window = None
    if v.startswith("sliding_window"):
        window = int(rng.integers(0, 600))
        params, var = variant_inputs(v, H, window)
    elif v == "causal":
        params, var = None, ref.Variant(causal=True)
    elif v in ("alibi",):
        params, var = variant_args(v, H, c["qo"], c["kv"], rng)
    else:
        params, var = variant_inputs(v, H)
    T = case.q.shape[0]
    w = BatchDecodeWrapper(H, Hk, c["head_dim"], c["page"], max_batch=len(c["kv"]) + 3,
                           max_pages=int(case.kv_indptr[-1]) + 5, max_qo_tokens=T + 8, variant=v,
                           dtype=c["dtype"], kv_layout=c["layout"])
    w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, qo_indptr=case.qo_indptr, window_left=window)
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full((T, H), float("nan"), device="cuda")
    w.run(case.q, case.k_cache, case.v_cache, out=out, lse=lse, params=params)
    torch.cuda.synchronize()
    return case, out.float().cpu().numpy(), lse.cpu().numpy(), var


def _prefill(c, rng):
    from prefill_cases import make_case, run_prefill, variant_args
    H, Hk = c["heads"]
    case = make_case(c["kv"], H, Hk, c["head_dim"], c["page"], dtype=c["dtype"], kv_layout=c["layout"],
                     qo_lens=c["qo"], seed=c["seed"])
    params, var = variant_args(c["variant"], H, c["qo"], c["kv"], rng)
    spec = c["variant"]
    if "+" in spec:
        from prefill_cases import combo_spec
        spec = combo_spec(spec, c["dtype"], c["head_dim"])
    o, lse, _ = run_prefill(case, spec, c["dtype"], params, ragged=c["family"] == "prefill-ragged")
    return case, o, lse, var


def _cascade(c, rng):
    import cascade_cases as cc
    H, Hk = c["heads"]
    batch = cc.one_prefix_batch(c["batch"], c["prefix"], c["suffix"], c["page"], seed=c["seed"])
    qo = np.arange(c["batch"] + 1, dtype=np.int32) * c["mtd"]
    case = cc.gpu_case(batch, H, Hk, c["head_dim"], c["page"], dtype=c["dtype"], qo=qo, seed=c["seed"])
    variant = c["variant"] if c["mtd"] == 1 else "causal"
    w = cc.gpu_wrapper(case, variant=variant, prefill="auto")
    out, lse = cc.gpu_run(case, w, variant)
    return case, out, lse, cc.REF[variant]


def run_case(c: dict) -> tuple[float, float]:
    from decode_cases import lse_error, rel_error
    rng = np.random.default_rng(c["seed"] + 7)
    if c["family"] == "cascade":
        import cascade_cases as cc
        case, out, lse, var = _cascade(c, rng)
        return cc.gpu_errors(case, out, lse, var)
    case, o, lse, var = (_decode if c["family"].startswith("decode") else _prefill)(c, rng)
    want_o, want_lse = case.reference(var)
    return rel_error(o, want_o), lse_error(lse, want_lse)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:50", help="START:END (END excluded)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no case after this many seconds")
    ap.add_argument("--list", action="store_true", help="print the cases only (no GPU)")
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.seeds.split(":"))
    t0, bad, done = time.time(), 0, 0
    for seed in range(lo, hi):
        if a.budget_s is not None and time.time() - t0 > a.budget_s:
            break
        c = draw(seed)
        if a.list:
            print(f"{seed:5d} {describe(c)}")
            continue
        print(f"start {seed}", flush=True)
        t = time.time()
        try:
            eo, el = run_case(c)
            ok = eo < TOL[c["dtype"]] and el < 2e-2
            bad += not ok
            print(f"{'PASS' if ok else 'FAIL'} {seed:5d} {describe(c)} O {eo:.2e} LSE {el:.2e} ({time.time() - t:.1f} s)",
                  flush=True)
        except Exception as e:   # a refusal is a finding too: these shapes are all meant to run
            bad += 1
            print(f"EXC  {seed:5d} {describe(c)}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
        done += 1
    if not a.list:
        print(f"{done - bad}/{done} cases passed (seeds {lo}:{hi})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
