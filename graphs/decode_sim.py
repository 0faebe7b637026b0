"""A synthetic serving batch for the demos: requests that grow by one token per step, finish
at their target length and are replaced by joining requests, over a page pool handed out in
random order (so page ids are scattered, as in a real server). Host-only, deterministic."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class PageAllocator:
    """A free list over [0, num_pages), shuffled once so ids come out scattered."""

    def __init__(self, num_pages: int, rng):
        self.free = [int(p) for p in rng.permutation(num_pages)]
        self.num_pages = num_pages

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError(f"page pool of {self.num_pages} pages exhausted")
        return self.free.pop()

    def release(self, pages) -> None:
        self.free.extend(pages)


@dataclass
class Request:
    rid: int
    length: int           # KV tokens, including this step's token
    target: int           # finishes once length reaches it
    pages: list = field(default_factory=list)


class DecodeBatch:
    """`kv()` gives this step's (kv_indptr, kv_indices, kv_last_page_len); `advance()` moves to
    the next step: every request gains a token, finished ones leave, new ones may join."""

    def __init__(self, max_batch: int, page_size: int, max_len: int, seed: int = 0, join_prob: float = 0.5,
                 max_new_tokens: int = 96):
        self.rng = np.random.default_rng(seed)
        self.max_batch, self.page_size, self.max_len, self.join_prob = max_batch, page_size, max_len, join_prob
        self.max_new_tokens = max_new_tokens
        self.pool_pages = max_batch * (-(-max_len // page_size)) + max_batch
        self.alloc = PageAllocator(self.pool_pages, self.rng)
        self.requests: list[Request] = []
        self.next_id = 0
        self.finished = self.joined = 0
        for _ in range(max_batch):
            self._join()

    def _join(self) -> None:
        new = max(1, min(self.max_new_tokens, self.max_len // 2))
        prompt = int(self.rng.integers(1, max(2, self.max_len - new)))
        target = min(self.max_len, prompt + int(self.rng.integers(1, new + 1)))
        r = Request(self.next_id, 0, target)
        self.next_id += 1
        self._grow(r, prompt)
        self.requests.append(r)

    def _grow(self, r: Request, tokens: int) -> None:
        for _ in range(tokens):
            if r.length % self.page_size == 0:   # last page full (or no page yet)
                r.pages.append(self.alloc.alloc())
            r.length += 1

    def advance(self) -> tuple[int, int]:
        """Next step; returns (finished, joined) this step."""
        done = [r for r in self.requests if r.length >= r.target]
        for r in done:
            self.alloc.release(r.pages)
        self.requests = [r for r in self.requests if r.length < r.target]
        for r in self.requests:
            self._grow(r, 1)
        joined = 0
        for _ in range(self.max_batch - len(self.requests)):
            if self.rng.random() < self.join_prob or not self.requests:
                self._join()
                joined += 1
        self.finished += len(done)
        self.joined += joined
        return len(done), joined

    @property
    def size(self) -> int:
        return len(self.requests)

    def kv(self):
        lens = np.array([r.length for r in self.requests], dtype=np.int64)
        pages = [len(r.pages) for r in self.requests]
        indptr = np.zeros(len(pages) + 1, np.int32)
        np.cumsum(pages, out=indptr[1:])
        indices = np.array([p for r in self.requests for p in r.pages], dtype=np.int32)
        last = (lens - (np.array(pages) - 1) * self.page_size).astype(np.int32)
        return indptr, indices, last
