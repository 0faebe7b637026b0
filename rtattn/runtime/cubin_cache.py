"""On-disk CUBIN cache shared by processes, with an in-process memo on top.

An entry is one file ``<key>.bin``: magic, sha256 of the payload, then the
payload (a JSON header with lowered names and the log, then the CUBIN). Writes
go to a temp file in the same directory and are published with ``os.replace``,
so concurrent writers never expose a torn entry; a torn or corrupt entry fails
its checksum and is rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from pathlib import Path

__all__ = ["cache_dir", "cache_stats", "load", "store", "memo_get", "memo_put", "clear_memo"]

_MAGIC = b"RTATCUB1"
_lock = threading.Lock()
_memo: dict[str, tuple[bytes, dict]] = {}
_stats = {"memo_hits": 0, "disk_hits": 0, "misses": 0, "corrupt": 0, "compiles": 0, "write_errors": 0}


def cache_dir() -> Path:
    """``$RTATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/rtattn``, else ``~/.cache/rtattn``."""
    env = os.environ.get("RTATTN_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rtattn"


def cache_stats(reset: bool = False) -> dict:
    """Counters since start (or the last reset): memo_hits, disk_hits, misses,
    corrupt, compiles, write_errors."""
    with _lock:
        out = dict(_stats)
        if reset:
            for k in _stats:
                _stats[k] = 0
    return out


def bump(counter: str) -> None:
    with _lock:
        _stats[counter] += 1


def memo_get(key: str):
    with _lock:
        hit = _memo.get(key)
        if hit is not None:
            _stats["memo_hits"] += 1
        return hit


def memo_put(key: str, cubin: bytes, meta: dict) -> None:
    with _lock:
        _memo[key] = (cubin, meta)


def clear_memo() -> None:
    """Forget the in-process memo (tests use it to exercise the disk cache)."""
    with _lock:
        _memo.clear()


def _entry(key: str) -> Path:
    return cache_dir() / "cubin" / f"{key}.bin"


def _complete(meta, names) -> bool:
    """What compile_to_cubin reads: {"lowered": {name: symbol} for every name, "log": str}. An
    entry written by another version (valid checksum, other metadata) is a miss, not a KeyError."""
    if not isinstance(meta, dict) or not isinstance(meta.get("log"), str):
        return False
    lowered = meta.get("lowered")
    return isinstance(lowered, dict) and all(isinstance(lowered.get(n), str) for n in names)


def load(key: str, names=()):
    """(cubin, meta) from disk, or None on a miss. A corrupt entry, or one whose metadata lacks
    the log or the lowered symbol of any of `names`, is removed (and so rebuilt)."""
    path = _entry(key)
    try:
        blob = path.read_bytes()
    except OSError:
        bump("misses")
        return None
    try:
        if blob[:8] != _MAGIC or hashlib.sha256(blob[40:]).digest() != blob[8:40]:
            raise ValueError("checksum mismatch")
        (meta_len,) = struct.unpack_from("<I", blob, 40)
        meta = json.loads(blob[44:44 + meta_len])
        cubin = blob[44 + meta_len:]
        if not cubin or not _complete(meta, names):
            raise ValueError("incomplete entry")
    except Exception:
        bump("corrupt")
        bump("misses")
        try:
            path.unlink()
        except OSError:
            pass
        return None
    bump("disk_hits")
    return cubin, meta


def store(key: str, cubin: bytes, meta: dict) -> None:
    """Publish an entry atomically; an unwritable cache only costs recompiles."""
    path = _entry(key)
    meta_raw = json.dumps(meta, sort_keys=True).encode()
    payload = struct.pack("<I", len(meta_raw)) + meta_raw + cubin
    blob = _MAGIC + hashlib.sha256(payload).digest() + payload
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError:
        bump("write_errors")
