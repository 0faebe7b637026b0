#!/usr/bin/env python3
"""Scan CUBINs for two things ptxas can do that the source does not show. Needs cuobjdump (CUDA's,
or a wheel's: --cuobjdump PATH); no GPU.

- Async copies (LDGSTS) that read a uniform register no instruction of their kernel writes: the
  miscompile that made every fp8 decode kernel die with an illegal instruction on the H200
  (ptx.cuh, cp_async_16_generic).
- Warp-specialized prefill kernels (names with "_ws_..._kvN_") whose consumers wait for PV before
  most of the softmax instead of after it: fewer than N / 4 MUFU (half a KV block's exponentials
  per thread: 64 rows x N columns over 128 threads) between a wait for all but one product group
  (WARPGROUP.DEPBAR.LE gsb0, 0x1) and the next wait for all (0x0). ptxas hoists that wait to the
  top of its basic block (prefill_ws.cuh, the q release's branch); a predicated release left 5
  of 32 there (session 11).

    python tools/scan_sass.py [--cuobjdump PATH] CUBIN_OR_DIR ...   # e.g. a CUBIN cache
(a cache folder keeps older sources' builds too: scan one that a single rtattn-compile filled.) Exit 1 if any kernel has either, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

_INSTR = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+(.*?)\s*;")


def unwritten_uniform_reads(sass: str) -> list[tuple[str, str]]:
    """(kernel, instruction) for each LDGSTS reading a uniform register its kernel never writes."""
    bad = []
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        name, body = fn.split("\n", 1)
        written, copies = set(), []
        for op, args in _INSTR.findall(body):
            regs = {int(r) for r in re.findall(r"\bUR(\d+)\b", args)}
            if op.startswith("LDGSTS"):
                copies.append((f"{op} {args}", regs))
            else:
                dst = re.match(r"UR(\d+)", args)
                if dst:   # a uniform destination; 64-bit forms write the pair
                    written.add(int(dst.group(1)))
                    if ".64" in op or "WIDE" in op:
                        written.add(int(dst.group(1)) + 1)
        bad += [(name.strip(), text) for text, regs in copies if regs - written]
    return bad


def softmax_after_pv(sass: str) -> list[str]:
    """Warp-specialized prefill kernels with a wait for one product group (S) followed by the wait
    for all (PV) and fewer than tile_kv / 4 MUFU between them: the softmax was not issued under PV."""
    bad = []
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        name, body = fn.split("\n", 1)
        tile_kv = re.search(r"_ws_q\d+_kv(\d+)_", name)
        if not tile_kv or "merge" in name:
            continue
        need = int(tile_kv.group(1)) // 4
        window = None   # MUFU count since the last wait for one group, or None outside such a window
        for op, args in _INSTR.findall(body):
            if op == "WARPGROUP.DEPBAR.LE":
                if window is not None and window < need and args.endswith("0x0"):
                    bad.append(name.strip())
                    break
                window = 0 if args.endswith("0x1") else None
            elif window is not None and op.startswith("MUFU"):
                window += 1
    return bad


def _images(path: pathlib.Path):
    """(name, ELF bytes) of a CUBIN file, or of every file under a folder that holds one (the
    CUBIN cache's entries carry a header before the image)."""
    for f in (sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]):
        blob = f.read_bytes()
        at = blob.find(b"\x7fELF")
        if at >= 0:
            yield f.name, blob[at:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="CUBIN files, or folders holding them (e.g. the CUBIN cache)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="cuobjdump to use (default: on PATH)")
    a = ap.parse_args(argv)
    if not a.cuobjdump:
        print("scan_sass: no cuobjdump on PATH (pass --cuobjdump)", file=sys.stderr)
        return 2
    missing = [p for p in a.paths if not pathlib.Path(p).exists()]
    if missing:
        print(f"scan_sass: no such file or folder: {missing[0]}", file=sys.stderr)
        return 2
    images = [img for p in a.paths for img in _images(pathlib.Path(p))]
    if not images:
        print("scan_sass: no CUBIN found", file=sys.stderr)
        return 2
    bad = late = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, image in images:
            f = pathlib.Path(tmp, "k.cubin")
            f.write_bytes(image)
            sass = subprocess.run([a.cuobjdump, "-sass", str(f)], capture_output=True, text=True, check=True).stdout
            for kernel, text in unwritten_uniform_reads(sass):
                bad += 1
                print(f"{name}: {kernel}: {text}")
            for kernel in softmax_after_pv(sass):
                late += 1
                print(f"{name}: {kernel}: the softmax waits for PV (under a quarter of a block's exponentials between the waits)")
    print(f"scan_sass: {len(images)} CUBINs, {bad} copies reading unwritten uniform registers, "
          f"{late} warp-specialized kernels with the softmax after PV")
    return 1 if bad or late else 0


if __name__ == "__main__":
    sys.exit(main())
