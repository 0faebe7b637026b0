"""A plan set: several plans and arrays at fixed offsets in one buffer.

A cascade step needs more than one plan's worth of arrays (a plan per kernel family, the
positions of every level, the fold map). Laying them out once, at offsets fixed when the
wrapper is built, keeps the step to one pinned buffer and one host-to-device copy, and every
kernel argument a fixed pointer (graphs stay valid). Each part is either a PlanLayout (its
own field table at its own base) or a plain int32 array of a fixed capacity.
"""
from __future__ import annotations

import numpy as np

from .fields import PlanLayout, align_up


class PlanSet:
    def __init__(self, parts: dict):
        """parts: name -> PlanLayout, or name -> capacity (int32 elements)."""
        self.parts = dict(parts)
        self.offsets: dict[str, int] = {}
        off = 0
        for name, part in self.parts.items():
            self.offsets[name] = off
            size = part.plan_bytes if isinstance(part, PlanLayout) else max(int(part), 1) * 4
            off = align_up(off + size)
        self.plan_bytes = off

    def allocate(self) -> np.ndarray:
        return np.zeros(self.plan_bytes, np.uint8)

    def views(self, buf: np.ndarray) -> dict:
        """name -> the part's views (a PlanLayout's field dict, or an int32 array) into buf."""
        raw = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
        raw = raw.reshape(-1).view(np.uint8)
        if raw.nbytes < self.plan_bytes:
            raise ValueError(f"plan buffer has {raw.nbytes} bytes, the plan set needs {self.plan_bytes}")
        out = {}
        for name, part in self.parts.items():
            o = self.offsets[name]
            if isinstance(part, PlanLayout):
                out[name] = part.views(raw[o:o + part.plan_bytes])
            else:
                out[name] = raw[o:o + max(int(part), 1) * 4].view(np.int32)
        return out

    def device_ptrs(self, base: int) -> dict:
        """name -> device address of the part (for a PlanLayout: field -> address)."""
        out = {}
        for name, part in self.parts.items():
            o = base + self.offsets[name]
            out[name] = {f: o + fo for f, fo in part.offsets.items()} if isinstance(part, PlanLayout) else o
        return out

    def table(self) -> list[tuple[str, int, int]]:
        """(part, offset, bytes) in buffer order."""
        names = list(self.parts)
        ends = [self.offsets[n] for n in names[1:]] + [self.plan_bytes]
        return [(n, self.offsets[n], e - self.offsets[n]) for n, e in zip(names, ends)]
