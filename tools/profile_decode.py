#!/usr/bin/env python3
"""Run one bench_decode row's rtattn call a few times, eagerly, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:rtattn_ --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python tools/profile_decode.py b16-u512-kv4

The first call (launches 0-1: decode + merge) warms caches and modules; skip it, profile the
second. Inputs, lengths and page tables are bench_decode's, so ncu's kernel durations line up
with the benchmark's rows. `--lib fi-tc` / `fi-cc` runs FlashInfer's wrapper on the same inputs
instead (source tools/peer_setup.sh; ncu --kernel-name regex:Batch...), for side-by-side sections.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("row", help="a bench_decode row name")
    ap.add_argument("--config", default="auto", help="rtattn config MODE[+flags] (bench_decode --rt-modes)")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--lib", default="rt", choices=["rt", "fi-tc", "fi-cc"])
    args = ap.parse_args(argv)
    import torch
    (row,) = bd.select_rows([args.row])
    x = bd.Inputs(row)
    if args.lib != "rt":
        return profile_flashinfer(x, args.lib == "fi-tc", args.calls)
    w = bd.make_rt_wrapper(row, x, args.config)
    w.plan(x.indptr, x.indices, x.last)
    out = x.new_outs()[0]
    launch = w.prepare(x.q[0], *x.kv[0], out=out)
    for _ in range(args.calls):
        launch()
        torch.cuda.synchronize()
    err = x.rel_err([out])
    info = w.info
    print(f"{row.name}: {w.num_ctas} CTAs x {row.hkv} KV heads, {info.num_items} items, "
          f"{info.num_merge_rows} merge rows, rel err {err:.1e} {'ok' if err < bd.TOL else 'FAIL'}")
    return 0 if err < bd.TOL else 1


def profile_flashinfer(x, tc: bool, calls: int) -> int:
    import flashinfer
    import torch
    row = x.row
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", use_tensor_cores=tc)
    indptr, indices, last = (torch.from_numpy(a).cuda() for a in (x.indptr, x.indices, x.last))
    w.plan(indptr, indices, last, row.hq, row.hkv, bd.HEAD_DIM, bd.PAGE,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = x.new_outs()[0]
    for _ in range(calls):
        w.run(x.q[0], x.kv[0], out=out)
        torch.cuda.synchronize()
    err = x.rel_err([out])
    print(f"{row.name} FlashInfer {'tc' if tc else 'cc'}: rel err {err:.1e} {'ok' if err < bd.TOL else 'FAIL'}")
    return 0 if err < bd.TOL else 1


if __name__ == "__main__":
    sys.exit(main())
