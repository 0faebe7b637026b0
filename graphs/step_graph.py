"""One graph for a whole decode step: every layer's attention captured once, replayed per step.

The lowest-overhead way to use rtattn without a framework graph: prepare one DecodeLaunch per
layer (pointers fixed; q/out views start at their buffer's base, so they stay the same when
the batch grows or shrinks), capture them all, then per step only plan() and replay():

    launches = [w.prepare(q[l][:n], k[l], v[l], out=o[l][:n], stream=s) for l in range(L)]
    sg = StepGraph(launches, s)
    for step ...:
        w.plan(...)      # one async H2D copy on s
        sg.replay()      # all L layers' attention launches, one cuGraphLaunch

When the launches change (a reallocated cache), `rebind(new_launches)` captures again and
updates the executable graph in place; it re-instantiates only if the topology changed.

A launch whose kernel list follows its plan (a CascadeLaunch: with or without the prefill
kernel) gets an executable per list it has held (keyed by the launches' `config_key`s),
captured the first time a plan needs it; replans that keep the list replay the same one.
"""
from __future__ import annotations

import logging

from . import graph as G

log = logging.getLogger("rtattn.graphs")


class StepGraph:
    def __init__(self, launches, stream):
        self.stream = G.capturable_stream(stream)
        self.launches = list(launches)
        self._checks = _plan_checks(self.launches)
        self.stats = dict(captures=0, instantiations=0, updates=0, reinstantiations=0, replays=0)
        self._execs: dict = {}   # the launches' config keys -> executable graph
        self.exec = self._exec_for(self._key())

    def _key(self) -> tuple:
        return tuple(x.config_key for x in self.launches)

    def _exec_for(self, key):
        ex = self._execs.get(key)
        if ex is None:
            ex = self._execs[key] = self._capture().instantiate()
            self.stats["instantiations"] += 1
        return ex

    def _capture(self):
        s, launches = self.stream, self.launches
        g = G.capture(lambda: [launch(s) for launch in launches], s)
        self.stats["captures"] += 1
        return g

    def replay(self) -> None:
        for launch in self._checks:   # a replan to another window or more tokens needs prepare() again
            launch.check_plan()
        self.exec = self._exec_for(self._key())
        self.exec.launch(self.stream)
        self.stats["replays"] += 1

    def rebind(self, launches) -> bool:
        """New launches (new pointers); True if updated in place, False if re-instantiated."""
        self.launches = list(launches)
        self._checks = _plan_checks(self.launches)
        key = self._key()
        for k in [k for k in self._execs if k != key]:   # the other lists' graphs hold the old arguments
            self._execs.pop(k).destroy(graph_too=True)
        ex = self._execs.get(key)
        if ex is None:
            self.exec = self._exec_for(key)
            return False
        g = self._capture()
        res = ex.update(g)
        if res:
            g.destroy()
            self.exec = ex
            self.stats["updates"] += 1
            return True
        log.warning("StepGraph: cuGraphExecUpdate refused (%s); re-instantiating", res.reason)
        ex.destroy(graph_too=True)
        self.exec = self._execs[key] = g.instantiate()
        self.stats["reinstantiations"] += 1
        self.stats["instantiations"] += 1
        return False

    def close(self) -> None:
        for ex in self._execs.values():
            ex.destroy(graph_too=True)
        self._execs.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _plan_checks(launches) -> list:
    """One launch per (wrapper, planned window, query tokens) among `launches` that can check
    their plan: what replay() checks."""
    return list({(id(x.wrapper), x.window_left, x.tokens): x for x in launches
                 if hasattr(x, "check_plan")}.values())
