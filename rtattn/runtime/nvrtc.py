"""NVRTC: CUDA C++ source -> CUBIN, through the CUBIN cache.

Every compile gets ``-std=c++17``, the package's ``cuda_src/`` and the CUDA
headers from the nvidia wheels as include paths. The cache key covers the
source, the options, the arch, the NVRTC version, the name expressions and the
contents of every header under ``cuda_src/`` and the extra include dirs, so an
edited header never serves a stale CUBIN.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from cuda.bindings import nvrtc

from . import cubin_cache
from .cubin_cache import cache_dir, cache_stats, clear_memo
from .driver import CudaError, Device, check

__all__ = ["CompileError", "CompiledModule", "compile_to_cubin", "nvrtc_version", "cuda_src_dir",
           "cuda_include_dir", "cache_dir", "cache_stats", "clear_memo", "Module", "Kernel"]

_HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".inc", ".inl")
_ARCH_RE = re.compile(r"^sm_\d{2,3}[af]?$")


class CompileError(CudaError):
    """NVRTC rejected a source; carries the compiler ``log`` and ``source_path``."""

    def __init__(self, message, *, log: str, source_path: str, name: str, arch: str, result_name: str):
        super().__init__(message, call="nvrtcCompileProgram", result_name=result_name)
        self.log = log
        self.source_path = source_path
        self.name = name
        self.arch = arch


class CompiledModule(bytes):
    """The CUBIN (it *is* the bytes) plus ``lowered`` names and the compiler ``log``."""

    lowered: dict
    log: str

    def __new__(cls, cubin: bytes, lowered: dict | None = None, log: str = ""):
        self = super().__new__(cls, cubin)
        self.lowered = dict(lowered or {})
        self.log = log
        return self

    @property
    def cubin(self) -> bytes:
        return bytes(self)


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def cuda_src_dir() -> Path:
    """The installed ``cuda_src/`` headers (package data of rtattn.cuda_src)."""
    return Path(str(importlib.resources.files("rtattn.cuda_src")))


@functools.cache
def cuda_include_dir() -> str:
    """CUDA toolkit headers (cuda_fp16.h, ...) from the nvidia-cuda-runtime wheel."""
    from cuda import pathfinder
    d = pathfinder.find_nvidia_header_directory("cudart")
    if not d:
        raise CudaError("CUDA headers not found: install nvidia-cuda-runtime (13.0.x)",
                        call="find_nvidia_header_directory")
    return str(d)


@functools.cache
def _toolchain_id() -> str:
    """Versions that change the CUBIN beyond the NVRTC version (the headers' wheel)."""
    from importlib import metadata
    parts = [f"nvrtc={nvrtc_version()}"]
    for dist in ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-nvrtc"):
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ";".join(parts)


def _header_files(root: str):
    """(path, mtime_ns, size) of every header under ``root``, sorted."""
    out, stack = [], [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            if e.is_dir():
                stack.append(e.path)
            elif e.name.endswith(_HEADER_SUFFIXES):
                st = e.stat()
                out.append((e.path, st.st_mtime_ns, st.st_size))
    return sorted(out)


_digest_memo: dict[tuple, str] = {}


def _headers_digest(dirs) -> str:
    """sha256 over the headers' relative names and contents. Re-read only when a
    header's (mtime, size) changes: the memo-hit path stays cheap."""
    files = tuple((str(d), tuple(_header_files(str(d)))) for d in dirs)
    digest = _digest_memo.get(files)
    if digest is None:
        h = hashlib.sha256()
        for root, entries in files:
            for path, _, _ in entries:
                try:
                    data = Path(path).read_bytes()
                except OSError:
                    continue
                h.update(os.path.relpath(path, root).encode() + b"\0" + data + b"\0")
        digest = h.hexdigest()
        # Like git's "racy" check: a header modified in the last 2 s could change
        # again within the same mtime tick, so do not trust its stat yet.
        newest = max((m for _, entries in files for _, m, _ in entries), default=0)
        if newest < time.time_ns() - 2_000_000_000:
            _digest_memo[files] = digest
    return digest


def _cache_key(source, options, arch, name_expressions, include_dirs) -> str:
    ident = {
        "source": source, "options": list(options), "arch": arch,
        "names": list(name_expressions), "toolchain": _toolchain_id(),
        "headers": _headers_digest([cuda_src_dir(), *include_dirs]),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _status(name: str, arch: str, quiet: bool | None):
    """A rich spinner on a TTY stderr, otherwise nothing."""
    if quiet or not (quiet is False or sys.stderr.isatty()):
        return contextlib.nullcontext()
    from rich.console import Console
    return Console(stderr=True).status(f"compiling {name} for {arch}…")


def _save_failed(source: str, name: str, key: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "kernel"
    for base in (cache_dir() / "failed", Path(tempfile.gettempdir()) / "rtattn-failed"):
        try:
            base.mkdir(parents=True, exist_ok=True)
            path = base / f"{stem}-{key[:12]}.cu"
            path.write_text(source)
            return str(path)
        except OSError:
            continue
    return "<not saved: no writable directory>"


def _program_log(prog) -> str:
    size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    # NVRTC writes into the buffer: a fresh bytearray, never bytes (b" " * 1 is CPython's shared
    # one-byte b" ", and an empty log's terminator would turn every b" " in the process into NUL)
    buf = bytearray(size)
    check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.rstrip(b"\0").decode(errors="replace").strip()


def _nvrtc_compile(source, name, arch, options, name_expressions, key) -> tuple[bytes, dict]:
    prog = check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()), f"nvrtcAddNameExpression({expr})")
        opts = [o.encode() for o in options]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        log = _program_log(prog)
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            path = _save_failed(source, name, key)
            raise CompileError(
                f"NVRTC failed to compile {name} for {arch} ({res.name}):\n{log}\n"
                f"source saved to {path}\noptions: {' '.join(options)}",
                log=log, source_path=path, name=name, arch=arch, result_name=res.name)
        size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        buf = bytearray(size)   # written by NVRTC: see _program_log
        check(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        lowered = {e: check(nvrtc.nvrtcGetLoweredName(prog, e.encode()), f"nvrtcGetLoweredName({e})").decode()
                   for e in name_expressions}
        return bytes(buf), {"lowered": lowered, "log": log}
    finally:
        check(nvrtc.nvrtcDestroyProgram(prog), "nvrtcDestroyProgram")


def compile_to_cubin(source: str, *, name: str, arch: str | None = None, options=(), include_dirs=(),
                     name_expressions=(), quiet: bool | None = None, use_cache: bool = True) -> CompiledModule:
    """Compile ``source`` to a CUBIN for ``arch`` ("sm_80", "sm_90", "sm_90a"; None:
    the current device). Returns a :class:`CompiledModule` (a ``bytes`` subclass
    with ``.lowered`` names for ``name_expressions`` and the ``.log``).
    Raises :class:`CompileError` with the log and the saved source path."""
    if arch is None:
        arch = Device().arch
    if not _ARCH_RE.match(arch):
        raise ValueError(f"arch must look like 'sm_90' or 'sm_90a' (a CUBIN needs a real arch), got {arch!r}")
    if isinstance(options, str) or isinstance(include_dirs, str) or isinstance(name_expressions, str):
        raise TypeError("options, include_dirs and name_expressions are sequences of strings, not a string")
    include_dirs = tuple(str(d) for d in include_dirs)
    user_options = tuple(options)
    key = _cache_key(source, user_options, arch, name_expressions, include_dirs) if use_cache else ""
    if use_cache:
        hit = cubin_cache.memo_get(key) or cubin_cache.load(key, name_expressions)
        if hit is not None:
            cubin, meta = hit
            cubin_cache.memo_put(key, cubin, meta)
            return CompiledModule(cubin, meta["lowered"], meta["log"])
    full = (f"--gpu-architecture={arch}", "-std=c++17",
            f"--include-path={cuda_src_dir()}", *(f"--include-path={d}" for d in include_dirs),
            f"--include-path={cuda_include_dir()}", *user_options)
    with _status(name, arch, quiet):
        cubin, meta = _nvrtc_compile(source, name, arch, full, tuple(name_expressions), key or "nocache")
    cubin_cache.bump("compiles")
    if use_cache:
        cubin_cache.store(key, cubin, meta)
        cubin_cache.memo_put(key, cubin, meta)
    return CompiledModule(cubin, meta["lowered"], meta["log"])


from .module import Kernel, Module  # noqa: E402  (re-exported: nvrtc is "the module cache")
