"""CUDA graphs of launches (a wrapper's run(), or any Launch), keyed by configuration, updated in place.

Why this works: the wrapper's plan lives at fixed workspace offsets, so a captured decode
kernel and merge kernel stay valid across plan() calls with any lengths; only the tensor
pointers (another layer's q/KV/out) change their argument struct. A configuration is what a
graph node fixes besides arguments: each call's kernel, grid, block, shared memory and PDL flag
(so launches of any kernel family, or several families in one launch, pool the same way). Per
configuration we keep up to `max_execs` executable graphs, each remembering the arguments it holds:

* same arguments as an existing exec       -> replay
* new arguments, room for another exec     -> capture + instantiate
* new arguments, pool full                 -> update the least recently used exec in place:
  kernel-node parameter update ("nodes", default: one driver call per kernel call, with the
  call's prepared node-parameter struct, no capture) or capture + cuGraphExecUpdate ("capture");
  re-instantiate only when the driver refuses the update (topology changed), counted and logged.

`max_execs=256` (default) keeps one exec per argument set a configuration has seen, up to 256:
a model's layers (each its own q/KV/out, the same tensors every step) replay with no update at
all, the cheapest host path (H200, bench_overhead "dg.stepL": 13.8-20.2 us per layer against
eager run()'s 17.9-26.3). `max_execs=1` is the minimal-memory policy: one exec per
configuration, its kernel nodes updated for every layer.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

from rtattn.runtime import CudaError

from . import graph as G

log = logging.getLogger("rtattn.graphs")

UPDATE_MODES = ("nodes", "capture")


def config_key(launch) -> tuple:
    """What fixes the captured topology and launch shapes (not the arguments) of a Launch."""
    return launch.config_key


class DecodeGraphs:
    """Graph replay of `wrapper.run()`; `step()` has run()'s signature and results. `replay()`
    takes any prepared Launch (decode, prefill, cascade, mixed)."""

    def __init__(self, wrapper=None, *, max_execs: int = 256, update: str = "nodes"):
        if update not in UPDATE_MODES:
            raise ValueError(f"update must be one of {UPDATE_MODES}, got {update!r}")
        if max_execs < 1:
            raise ValueError(f"max_execs must be >= 1, got {max_execs}")
        self.wrapper, self.max_execs, self.update_mode = wrapper, int(max_execs), update
        self.stats = dict(captures=0, instantiations=0, updates=0, param_updates=0,
                          reinstantiations=0, replays=0)
        self.reasons: list[str] = []   # why each re-instantiation happened
        self._pools: dict[tuple, OrderedDict] = {}
        self._stream = (None, None)    # (stream object, checked Stream): one check per new object

    # ----------------------------------------------------------------- the step
    def step(self, q, k_cache, v_cache=None, *, out=None, lse=None, stream=None, sm_scale=None,
             params=None, wrapper=None, k_scale=None, v_scale=None):
        """Like wrapper.run(), but replayed from a graph. `stream` must not be the legacy
        default stream. Validation is the wrapper's, done before anything is launched."""
        w = wrapper or self.wrapper
        if w is None:
            raise ValueError("no wrapper: pass DecodeGraphs(wrapper) or step(..., wrapper=w)")
        s = self._capturable(stream)
        launch = w._bind(w._reusable(keep_merge=True), q, k_cache, v_cache, out, lse, s, sm_scale, params,
                         k_scale, v_scale)
        self._replay(launch, s)
        return (launch.out, launch.lse) if launch.lse is not None else launch.out

    def replay(self, launch, stream) -> None:
        """Replay a prepared Launch through the graph pool of its configuration."""
        if hasattr(launch, "check_plan"):   # a wrapper's DecodeLaunch: the plan must still fit it
            launch.check_plan()
        self._replay(launch, self._capturable(stream))

    def _replay(self, launch, s) -> None:
        pool = self._pools.get(launch.config_key)
        if pool is None:
            pool = self._pools[launch.config_key] = OrderedDict()
        key = launch.params_key()
        ex = pool.get(key)
        if ex is not None:
            pool.move_to_end(key)
        elif len(pool) < self.max_execs:
            ex = self._capture(launch, s).instantiate()
            self.stats["instantiations"] += 1
            pool[key] = ex
        else:
            _, old = pool.popitem(last=False)
            ex = self._update(old, launch, s)
            pool[key] = ex
        ex.launch(s)
        self.stats["replays"] += 1

    # ------------------------------------------------------------ internals
    def _capturable(self, stream):
        if stream is self._stream[0] and stream is not None:
            return self._stream[1]
        s = G.capturable_stream(stream)
        self._stream = (stream, s)
        return s

    def _capture(self, launch, s):
        g = G.capture(lambda: launch(s), s)
        self.stats["captures"] += 1
        return g

    def _update(self, ex, launch, s):
        # node i is call i (checked once per exec: in-place updates keep its nodes)
        if self.update_mode == "nodes" and (getattr(ex, "nodes_are_calls", False) or _mark_match(ex, launch)):
            try:
                for i, call in enumerate(launch.calls):
                    ex.set_call_params(i, call)
                self.stats["param_updates"] += 1
                return ex
            except CudaError as e:  # fall back to the whole-graph update below
                log.info("kernel-node parameter update refused (%s); trying cuGraphExecUpdate", e)
        g = self._capture(launch, s)
        res = ex.update(g)
        if res:
            g.destroy()  # its parameters now live in `ex`
            self.stats["updates"] += 1
            return ex
        why = f"cuGraphExecUpdate refused ({res.reason}): re-instantiating {launch!r}"
        log.warning(why)
        self.reasons.append(why)
        ex.destroy(graph_too=True)
        self.stats["reinstantiations"] += 1
        self.stats["instantiations"] += 1
        return g.instantiate()

    @property
    def num_execs(self) -> int:
        return sum(len(p) for p in self._pools.values())

    def close(self) -> None:
        """Destroy every graph and executable graph now."""
        for pool in self._pools.values():
            for ex in pool.values():
                ex.destroy(graph_too=True)
        self._pools.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _mark_match(ex, launch) -> bool:
    ex.nodes_are_calls = ok = ex.matches(launch)
    return ok
