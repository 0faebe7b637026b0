"""rtattn-compile: build every kernel instance the package ships into the CUBIN cache.

Works without a GPU (NVRTC compiles to CUBIN for a named arch), so caches can be warmed ahead
of time, e.g. in a container build: `rtattn-compile --arch sm_90`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _compile_one(args):
    kind, key, arch = args
    t = time.perf_counter()
    if kind == "decode":
        from rtattn.codegen.spec import shipped_specs
        from rtattn.kernels import compile_spec
        spec = next(s for s in shipped_specs(arch) if s.uri == key)
        compile_spec(spec, arch, quiet=True)
    else:
        from rtattn import merge
        from rtattn.runtime import compile_to_cubin
        compile_to_cubin(merge.source(), name="merge_states", arch=arch, quiet=True)
    return key, time.perf_counter() - t


def _default_arch() -> str:
    from rtattn.runtime import Device, has_device
    if not has_device():
        raise SystemExit("rtattn-compile: no CUDA device here; name the target with --arch (e.g. sm_90)")
    return Device(0).arch


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    from rtattn.codegen.spec import shipped_specs
    from rtattn.runtime import cache_dir

    ap = argparse.ArgumentParser(prog="rtattn-compile", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", help="target, e.g. sm_80, sm_90 (default: the local GPU)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel NVRTC processes")
    ap.add_argument("--filter", default="", help="only instances whose name contains this text")
    args = ap.parse_args(argv)
    arch = args.arch or _default_arch()
    jobs = [("decode", s.uri, arch) for s in shipped_specs(arch) if args.filter in s.uri]
    if args.filter in "merge_states":
        jobs.append(("merge_states", "merge_states", arch))
    console = Console(stderr=False)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(_compile_one, jobs))
    total = time.perf_counter() - t0
    table = Table(title=f"rtattn-compile {arch} -> {cache_dir()}")
    table.add_column("instance")
    table.add_column("seconds", justify="right")
    for key, sec in results:
        table.add_row(key, f"{sec:.2f}")
    console.print(table)
    console.print(f"{len(results)} instances for {arch} in {total:.1f} s wall ({args.jobs} processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
