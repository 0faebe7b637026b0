"""Pack the CUBIN cache entries of today's shipped instances into one tarball for the device
(tools/kcache.sh unpacks it there), leaving out the stale entries an old tree left behind.

    RTATTN_CACHE_DIR=$PWD/.kcache rtattn-compile --arch sm_90      # fills the cache (CPU only)
    RTATTN_CACHE_DIR=$PWD/.kcache python tools/kcache_pack.py .kcache.tgz --exclude _float16_

Every shipped job is compiled again (a disk hit: no NVRTC) while the cache's load and store are
watched, so the entries packed are exactly the ones today's sources key to; --add keeps the
entries a device run compiled (KCACHE_BACK=1 tools/gpu_all.sh), once unpacked into the cache. --exclude drops
instances by name (the device tool carries at most 64 MiB, FlashInfer's wheels included)."""
from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the .tgz to write")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--exclude", action="append", default=[], help="leave out instances whose name contains this")
    ap.add_argument("--only", action="append", default=[], help="pack only instances whose name contains this")
    ap.add_argument("--add", action="append", default=[], metavar="TGZ",
                    help="also pack the entries of this tarball (gpu_all's kcache-new.tgz: tests' instances)")
    a = ap.parse_args(argv)
    from rtattn.cli.compile import _compile, shipped_jobs
    from rtattn.runtime import cubin_cache
    keys = []
    load, store = cubin_cache.load, cubin_cache.store

    def watch_load(key, names=()):
        hit = load(key, names)
        if hit is not None:
            keys.append(key)
        return hit

    def watch_store(key, cubin, meta):
        store(key, cubin, meta)
        keys.append(key)

    cubin_cache.load, cubin_cache.store = watch_load, watch_store
    jobs = [j for j in shipped_jobs(a.arch) if not any(x in j[1] for x in a.exclude)
            and (not a.only or any(x in j[1] for x in a.only))]
    for kind, name, arch in jobs:
        _compile(kind, name, arch)
    root = cubin_cache.cache_dir()
    files = {str(cubin_cache._entry(k).relative_to(root)) for k in keys}   # (the cache's own layout)
    for tgz in a.add:
        with tarfile.open(tgz) as t:
            files |= {n for n in t.getnames() if n.endswith(".bin") and (root / n).is_file()}
    files = sorted(files)
    subprocess.run(["tar", "czf", a.out, "-C", str(root), *files], check=True)
    print(f"{len(jobs)} instances, {len(files)} cache entries from {root} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
