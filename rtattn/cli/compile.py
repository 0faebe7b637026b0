"""rtattn-compile: build every kernel instance the package ships into the CUBIN cache.

Works without a GPU (NVRTC compiles to CUBIN for a named arch), so caches can be warmed ahead
of time, e.g. in a container build: `rtattn-compile --arch sm_90`. Bad arguments: one line on
stderr, exit status 2 (rtattn.cli).
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from rtattn.cli import CliError, Parser, run


def _compile_one(args):
    """(instance, seconds, None) or (instance, seconds, one-line NVRTC failure)."""
    from rtattn.runtime import CompileError
    kind, key, arch = args
    t = time.perf_counter()
    try:
        _compile(kind, key, arch)
    except CompileError as e:   # returned, not raised: it does not pickle across processes
        return key, time.perf_counter() - t, f"NVRTC failed for {e.name} ({e.arch}); source saved to {e.source_path}"
    return key, time.perf_counter() - t, None


def _compile(kind, key, arch):
    if kind == "decode":
        from rtattn.families import decode
        from rtattn.kernels import compile_spec
        spec = next(s for s in decode.shipped(arch) if s.uri == key)
        compile_spec(spec, arch, quiet=True)
    elif kind == "prefill":
        from rtattn.families import prefill
        spec, tile = next((s, t) for s, t in prefill.shipped(arch) if prefill.instance_name(s, t) == key)
        prefill.compile_prefill(spec, tile, arch, quiet=True)
    else:
        from rtattn import merge
        from rtattn.runtime import compile_to_cubin
        compile_to_cubin(merge.source(), name="merge_states", arch=arch, quiet=True)


def shipped_jobs(arch: str, text: str = "") -> list[tuple[str, str, str]]:
    """(family, instance name, arch) of every shipped instance whose name contains `text`: each
    decode spec, each prefill (spec, tile) and the merge_states kernel."""
    from rtattn.families import decode, prefill
    jobs = [("decode", s.uri, arch) for s in decode.shipped(arch) if text in s.uri]
    jobs += [("prefill", n, arch) for n in (prefill.instance_name(s, t) for s, t in prefill.shipped(arch))
             if text in n]
    if text in "merge_states":
        jobs.append(("merge_states", "merge_states", arch))
    if not jobs:
        raise CliError(f"--filter {text!r} matches no kernel instance (names look like "
                       f"{decode.shipped(arch)[0].uri}, {prefill.instance_name(*prefill.shipped(arch)[0])} or "
                       f"merge_states)")
    return jobs


def _default_arch() -> str:
    from rtattn.runtime import Device, has_device
    if not has_device():
        raise CliError("no CUDA device here; name the target with --arch (e.g. sm_90)")
    return Device(0).arch


def _main(argv) -> int:
    from rich.console import Console
    from rich.table import Table

    from rtattn.runtime import cache_dir

    ap = Parser(prog="rtattn-compile", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", help="target, e.g. sm_80, sm_90 (default: the local GPU's)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel NVRTC processes")
    ap.add_argument("--filter", default="", help="only instances whose name contains this text")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        raise CliError(f"--jobs must be >= 1, got {args.jobs}")
    from rtattn.kernels import check_arch
    arch = check_arch(args.arch or _default_arch())
    jobs = shipped_jobs(arch, args.filter)
    console = Console(stderr=False)
    t0 = time.perf_counter()
    workers = min(args.jobs, len(jobs))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile_one, jobs))
    failed = [err for _, _, err in results if err]
    if failed:   # not a usage error: exit 1, one line per failed instance (logs are saved)
        for err in failed:
            print(f"rtattn-compile: {err}", file=sys.stderr)
        return 1
    total = time.perf_counter() - t0
    table = Table(title=f"rtattn-compile {arch} -> {cache_dir()}")
    table.add_column("instance")
    table.add_column("seconds", justify="right")
    for key, sec, _ in results:
        table.add_row(key, f"{sec:.2f}")
    console.print(table)
    console.print(f"{len(results)} instances for {arch} in {total:.1f} s wall ({workers} processes)")
    return 0


def main(argv=None) -> int:
    return run("rtattn-compile", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
