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
        self.exec = self._capture().instantiate()
        self.stats["instantiations"] += 1

    def _capture(self):
        s, launches = self.stream, self.launches
        g = G.capture(lambda: [launch(s) for launch in launches], s)
        self.stats["captures"] += 1
        return g

    def replay(self) -> None:
        for launch in self._checks:   # a replan to another window or more tokens needs prepare() again
            launch.check_plan()
        self.exec.launch(self.stream)
        self.stats["replays"] += 1

    def rebind(self, launches) -> bool:
        """New launches (new pointers); True if updated in place, False if re-instantiated."""
        self.launches = list(launches)
        self._checks = _plan_checks(self.launches)
        g = self._capture()
        res = self.exec.update(g)
        if res:
            g.destroy()
            self.stats["updates"] += 1
            return True
        log.warning("StepGraph: cuGraphExecUpdate refused (%s); re-instantiating", res.reason)
        self.exec.destroy(graph_too=True)
        self.exec = g.instantiate()
        self.stats["reinstantiations"] += 1
        self.stats["instantiations"] += 1
        return False

    def close(self) -> None:
        self.exec.destroy(graph_too=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _plan_checks(launches) -> list:
    """One launch per (wrapper, planned window, query tokens) among `launches` that can check
    their plan: what replay() checks."""
    return list({(id(x.wrapper), x.window_left, x.tokens): x for x in launches
                 if hasattr(x, "check_plan")}.values())
