"""Queue order "request": a request's items dealt onto the CTA queues together, so that the
CTAs run them at about the same time and its KV lines are read from HBM once and from L2 after
(Planner(queue_order="request"); off by default: "lpt").

Why: LPT deals the items longest first, so at any moment the resident CTAs run equal-cost items
of different requests; at head group 1 a request's causal tiles all land on one queue, one after
another, and every tile re-reads its request's KV from HBM (tools/model_l2.py models it:
docs/perf-log.md "prefill queue order").

How (list scheduling over a request-grouped order):
  requests by their largest item, descending (ties: first in the batch first);
  consecutive requests form a round once it holds >= num_ctas items; the trailing rounds merge
  until the last holds >= 2 num_ctas (its small items level the loads, as LPT's tail does);
  a round's items longest first (ties: item order); each dealt in turn onto the least loaded
  CTA (ties: lowest id). A CTA's queue runs its items in the order dealt.
The caller keeps LPT's assignment when this one's heaviest CTA exceeds LPT's by more than
QUEUE_ORDER_SLACK. Integers and stable sorts only: deterministic.
"""
from __future__ import annotations

import numpy as np

from .costs import QUEUE_ORDER_SLACK
from .small import lpt_deal

QUEUE_ORDERS = ("lpt", "request")


def check_queue_order(queue_order) -> str:
    if queue_order not in QUEUE_ORDERS:
        raise ValueError(f"queue_order must be one of {QUEUE_ORDERS}, got {queue_order!r}")
    return queue_order


def request_rounds(req: np.ndarray, cost: np.ndarray, num_ctas: int, ar: np.ndarray):
    """(order, cta, loads) of the request order: `order` the items (indices into req / cost,
    int64) in dealing order, `cta` the CTA of each dealt item, `loads` int64[num_ctas]. A request
    is a run of consecutive items with the same `req` (the planner's items: tiles request-major,
    a tile's chunks together); `cost` int64; `ar` an arange at least len(req) + 1 long."""
    n, C = req.shape[0], num_ctas
    starts = np.flatnonzero(req[1:] != req[:-1]) + 1
    starts = np.concatenate(([0], starts))
    cnt = np.diff(np.append(starts, n))
    R = starts.shape[0]
    by_top = np.lexsort((ar[:R], -np.maximum.reduceat(cost, starts)))
    # rounds: cut before a request once the round holds >= C items
    rid = np.empty(R, dtype=np.int64)
    r_of, size, acc = 0, [], 0
    for r in by_top.tolist():
        if acc >= C:
            size.append(acc)
            r_of, acc = r_of + 1, 0
        rid[r] = r_of
        acc += int(cnt[r])
    size.append(acc)
    # the trailing rounds merge until the last holds >= 2C items
    last, tail = len(size) - 1, size[-1]
    while last > 0 and tail < 2 * C:
        last -= 1
        tail += size[last]
    np.minimum(rid, last, out=rid)
    item_round = rid.repeat(cnt)
    order = np.lexsort((ar[:n], -cost, item_round))
    cs = cost[order]
    shift = C.bit_length()
    cta = np.array(lpt_deal(ar[:C].tolist(), (cs << shift).tolist(), (1 << shift) - 1), dtype=np.int64)
    loads = np.bincount(cta, weights=cs, minlength=C).astype(np.int64)
    return order, cta, loads


def within_slack(loads: np.ndarray, lpt_top: int) -> bool:
    """True when the request order's heaviest CTA is within QUEUE_ORDER_SLACK of LPT's."""
    return int(loads.max()) <= QUEUE_ORDER_SLACK * lpt_top
