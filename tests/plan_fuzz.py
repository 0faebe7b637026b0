"""Random page tables, mostly malformed, and an independent oracle for them.

`cases(rng, cfg)` yields (args, kwargs) for `wrapper.plan(...)`: a valid table, then zero to two
random mutations (wrong dtypes and shapes, int32 overflow, non-monotone or shifted indptrs,
short arrays, page ids outside the pool, bad last-page lengths, exceeded bounds).
`judge(cfg, args, kwargs)` decides validity from the rules alone, in Python ints (no numpy
arithmetic that could wrap), and names the arrays (or bounds) a refusal may blame.
Used by tests/test_plan_fuzz.py (a seed set) and tools/fuzz_plan.py (100,000 cases).
`plan_outcome(p, args, kw, stale)` is what two planning paths must agree on (bytes over a stale
buffer, PlanInfo, the error): tests/test_small_plan.py and tests/test_tile_table_plan.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

I32_MIN, I32_MAX = -2**31, 2**31 - 1
NAMES = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")


@dataclass(frozen=True)
class Config:
    page_size: int
    max_batch: int
    max_pages: int
    pool: int           # num_pages_pool the wrapper is built with
    heads: tuple = (32, 8)

    @property
    def max_qo_tokens(self) -> int:   # the wrapper's default: max_batch
        return self.max_batch


CONFIGS = (Config(16, 8, 64, 80), Config(1, 16, 512, 600, (32, 32)), Config(64, 4, 40, 40, (32, 4)))


# ------------------------------------------------------------------ generation
def _valid(rng, cfg: Config):
    batch = int(rng.integers(0, cfg.max_batch + 1))
    budget = cfg.max_pages
    pages = []
    for _ in range(batch):
        p = int(rng.integers(0, max(1, min(budget, 12)) + 1)) if rng.random() < 0.9 else 0
        p = min(p, budget)
        budget -= p
        pages.append(p)
    kv_indptr = np.concatenate(([0], np.cumsum(pages, dtype=np.int64))).astype(np.int32)
    nnz = int(kv_indptr[-1])
    ids = rng.choice(cfg.pool, size=nnz, replace=nnz > cfg.pool).astype(np.int32)
    last = rng.integers(1, cfg.page_size + 1, batch).astype(np.int32)
    if rng.random() < 0.3:   # ignored entries of empty requests may hold anything
        last[np.asarray(pages, np.int64) == 0] = rng.integers(-5, 5)
    if rng.random() < 0.2:   # slack past nnz is allowed
        ids = np.concatenate((ids, rng.integers(-3, 2 * cfg.pool, 3).astype(np.int32)))
    args = [kv_indptr, ids, last]
    kwargs = {}
    if rng.random() < 0.15:   # explicit qo_indptr: a few multi-token queries within max_qo_tokens
        qo = np.ones(batch, np.int64)
        spare = cfg.max_qo_tokens - batch
        if batch and spare > 0:
            qo[int(rng.integers(0, batch))] += int(rng.integers(0, spare + 1))
        kwargs["qo_indptr"] = np.concatenate(([0], np.cumsum(qo))).astype(np.int32)
    return args, kwargs


def _get(args, kwargs, name):
    i = NAMES.index(name)
    return kwargs.get("qo_indptr") if i == 0 else args[i - 1]


def _set(args, kwargs, name, value):
    i = NAMES.index(name)
    if i == 0:
        kwargs["qo_indptr"] = value
    else:
        args[i - 1] = value


def _mutate(rng, cfg: Config, args, kwargs):
    name = NAMES[int(rng.integers(0 if "qo_indptr" in kwargs or rng.random() < 0.3 else 1, 4))]
    a = _get(args, kwargs, name)
    if a is None:   # qo_indptr not given: make it explicit first
        a = np.arange(np.size(args[0]), dtype=np.int32)
    a = np.array(a, copy=True)
    if a.ndim != 1 or a.dtype.kind not in "iu":   # already broken beyond value edits
        return
    if a.dtype != np.int32:   # value edits below need room for int32 extremes
        a = a.astype(np.int64)
    n = a.shape[0]
    k = int(rng.integers(0, 16))
    j = int(rng.integers(0, n)) if n else 0
    if k == 0:
        a = a.astype(rng.choice([np.float32, np.float64, np.bool_, np.uint8]))
    elif k == 1:
        a = a.astype(object) if rng.random() < 0.5 else a.astype(str)
    elif k == 2:
        a = a.reshape(1, n) if rng.random() < 0.5 else (a[:1].reshape(()) if n else a.reshape(0, 1))
    elif k == 3 and n:   # out of int32 (int64 input)
        a = a.astype(np.int64)
        a[j] = rng.choice([I32_MAX + 1, I32_MIN - 1, 2**40, -2**40])
    elif k == 4 and n:   # extremes that overflow int32 differences
        a[j] = rng.choice([I32_MAX, I32_MIN, I32_MIN + 1, I32_MAX - 1])
    elif k == 5 and n >= 3:   # the wrap-around pattern [0, 2**31-1, -2**31+1, ...]
        a[1], a[2] = I32_MAX, I32_MIN + 1
    elif k == 6 and n:
        a[j] = min(max(int(a[j]) + int(rng.choice([-1, 1, -2, 3, 100])), I32_MIN), I32_MAX)
    elif k == 7:   # drop or add an entry
        a = a[:-1] if n and rng.random() < 0.5 else np.append(a, a[-1] if n else 0).astype(a.dtype)
    elif k == 8:
        a = a[:0]
    elif k == 9 and n:
        a[j] = -int(a[j]) - 1 if a[j] > I32_MIN else I32_MAX
    elif k == 10 and n and name == "kv_indices":
        a[j] = rng.choice([cfg.pool, cfg.pool + 1, cfg.pool - 1, I32_MAX])
    elif k == 11 and n and name == "kv_last_page_len":
        a[j] = rng.choice([0, cfg.page_size, cfg.page_size + 1, -1, I32_MAX])
    elif k == 12:   # a batch past max_batch (consistent arrays)
        b = cfg.max_batch + int(rng.integers(1, 3))
        args[:] = [np.arange(b + 1, dtype=np.int32), np.arange(b, dtype=np.int32) % cfg.pool,
                   np.ones(b, np.int32)]
        kwargs.pop("qo_indptr", None)
        return
    elif k == 13:   # more pages than max_pages (consistent arrays)
        nnz = cfg.max_pages + int(rng.integers(1, 3))
        args[:] = [np.array([0, nnz], np.int32), np.arange(nnz, dtype=np.int32) % cfg.pool,
                   np.ones(1, np.int32)]
        kwargs.pop("qo_indptr", None)
        return
    elif k == 14:   # a long query past max_qo_tokens
        b = np.size(args[0]) - 1
        if b >= 1:
            qo = np.ones(b, np.int64)
            qo[0] = cfg.max_qo_tokens
            kwargs["qo_indptr"] = np.concatenate(([0], np.cumsum(qo))).astype(np.int32)
        return
    elif k == 15:
        a = a.tolist()
    _set(args, kwargs, name, a)


def cases(rng, cfg: Config):
    """One (args, kwargs) case for wrapper.plan."""
    args, kwargs = _valid(rng, cfg)
    for _ in range(int(rng.choice([0, 1, 1, 1, 2]))):
        _mutate(rng, cfg, args, kwargs)
    return args, kwargs


# ------------------------------------------------------------------ the oracle
class Invalid(Exception):
    """A case breaks rules; `names` are the arrays (or bounds) of every broken rule: an error
    message must name at least one of them (the validator may find any of them first)."""

    def __init__(self, names):
        super().__init__(", ".join(sorted(names)))
        self.names = set(names)


def _ints(name, a, bad):
    arr = np.asarray(a)
    if (arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f")) or arr.ndim != 1:
        bad.add(name)
        return None
    vals = [int(x) for x in arr.tolist()]
    if any(v < I32_MIN or v > I32_MAX for v in vals):
        bad.add(name)
        return None
    return vals


def _lengths(name, ptr, bad):
    if ptr is None:
        return None
    d = [b - a for a, b in zip(ptr, ptr[1:])]
    if not ptr or ptr[0] != 0 or any(x < 0 for x in d):
        bad.add(name)
        return None
    return d


def judge(cfg: Config, args, kwargs):
    """(qo_len, kv_len, nnz) for a valid case; raises Invalid naming every broken rule."""
    bad = set()
    kv_ptr = _ints("kv_indptr", args[0], bad)
    ids = _ints("kv_indices", args[1], bad)
    last = _ints("kv_last_page_len", args[2], bad)
    if kwargs.get("qo_indptr") is not None:
        qo_ptr = _ints("qo_indptr", kwargs["qo_indptr"], bad)
    else:   # decode: one query per request
        qo_ptr = list(range(len(kv_ptr))) if kv_ptr is not None else None
    qo_len = _lengths("qo_indptr", qo_ptr, bad)
    pages = _lengths("kv_indptr", kv_ptr, bad)
    batch = len(qo_len) if qo_len is not None else None
    if batch is not None and kv_ptr is not None and len(kv_ptr) != batch + 1:
        bad |= {"kv_indptr", "qo_indptr"}
    if batch is not None and last is not None and len(last) != batch:
        bad.add("kv_last_page_len")
    if batch is not None and batch > cfg.max_batch:
        bad.add("max_batch")
    if qo_ptr and qo_ptr[-1] > cfg.max_qo_tokens:
        bad.add("max_qo_tokens")
    if pages is not None:
        nnz = kv_ptr[-1]
        if nnz * cfg.page_size > I32_MAX:
            bad.add("kv_indptr")
        if nnz > cfg.max_pages:
            bad.add("max_pages")
        if ids is not None and (len(ids) < nnz or any(not 0 <= i < cfg.pool for i in ids[:nnz])):
            bad.add("kv_indices")
        if last is not None and any(p > 0 and not 1 <= n <= cfg.page_size for p, n in zip(pages, last)):
            bad.add("kv_last_page_len")
    if bad:
        raise Invalid(bad)
    kv_len = [(p - 1) * cfg.page_size + n if p else 0 for p, n in zip(pages, last)]
    return qo_len, kv_len, kv_ptr[-1]


# ------------------------------------------------------------------ one case through a wrapper
def wrappers(monkeypatch):
    """One BatchDecodeWrapper per Config, on the fake GPU (tests/fakes.py)."""
    import fakes
    from rtattn import wrapper as W
    fakes.install(monkeypatch, fakes.FakeKernels)
    return [(cfg, W.BatchDecodeWrapper(*cfg.heads, 128, cfg.page_size, max_batch=cfg.max_batch,
                                       max_pages=cfg.max_pages, num_pages_pool=cfg.pool))
            for cfg in CONFIGS]


def check_case(w, cfg: Config, args, kwargs) -> str | None:
    """None if wrapper.plan did the right thing, else what went wrong (one line)."""
    from rtattn.plan.verify import verify_plan
    try:
        want = judge(cfg, args, kwargs)
    except Invalid as inv:
        try:
            w.plan(*args, **kwargs)
        except (ValueError, TypeError) as e:
            msg = str(e)
            if any(n in msg for n in inv.names):
                return None
            return f"refusal names none of {sorted(inv.names)}: {type(e).__name__}: {msg}"
        except Exception as e:   # noqa: BLE001  (anything else is a finding)
            return f"{type(e).__name__} (not ValueError/TypeError) for invalid {sorted(inv.names)}: {e}"
        return f"accepted an invalid table ({', '.join(sorted(inv.names))})"
    qo_len, kv_len, nnz = want
    try:
        info = w.plan(*args, **kwargs)
    except Exception as e:   # noqa: BLE001
        return f"refused a valid table: {type(e).__name__}: {e}"
    v, b = info.views, len(kv_len)
    try:
        verify_plan(v, qo_len, kv_len, tile_q=w.planner.tile_q, page_size=cfg.page_size)
    except AssertionError as e:
        return f"verify_plan: {e}"
    if v["req_kv_len"][:b].tolist() != kv_len or v["req_qo_len"][:b].tolist() != qo_len:
        return "plan lengths differ from the table's"
    if v["kv_indices"][:nnz].tolist() != [int(x) for x in np.asarray(args[1])[:nnz].tolist()]:
        return "plan page ids differ from the table's"
    return None


def fuzz(monkeypatch, n: int, seed: int = 0, on_failure=None) -> dict:
    """Run n cases; counts of valid/invalid cases and of failures by kind."""
    rng = np.random.default_rng(seed)
    ws = wrappers(monkeypatch)
    stats = dict(cases=0, valid=0, invalid=0, failures=0, invalid_accepted=0)
    for i in range(n):
        cfg, w = ws[i % len(ws)]
        args, kwargs = cases(rng, cfg)
        try:
            judge(cfg, args, kwargs)
            stats["valid"] += 1
        except Invalid:
            stats["invalid"] += 1
        err = check_case(w, cfg, args, kwargs)
        stats["cases"] += 1
        if err:
            stats["failures"] += 1
            stats["invalid_accepted"] += err.startswith("accepted")
            if on_failure:
                on_failure(i, args, kwargs, err)
    return stats


def plan_outcome(p, args, kw, stale):
    """Planner p's plan of `args` into a copy of `stale`: (the buffer, PlanInfo's fields or the
    error's type and message) -- what two planning paths must agree on."""
    buf = stale.copy()
    try:
        info = p.plan(*args, out=buf, **kw)
    except (ValueError, TypeError) as e:
        return buf, f"{type(e).__name__}: {e}"
    fields = (info.num_items, info.num_merge_rows, info.num_partial_rows, info.batch, info.num_qo_tokens,
              info.num_ctas, info.tile_q, info.page_size, info.chunk_tokens, info.num_split_tiles, info.mode,
              info.cta_loads.dtype, info.cta_loads.tolist())
    return buf, fields
