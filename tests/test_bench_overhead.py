"""tools/bench_overhead.py on the CPU: its closing summary (the timed runs need a GPU and
FlashInfer): short enough to survive a log's tail, every target's figure in it."""
from __future__ import annotations

import tool_module

bench = tool_module.load("bench_overhead")


def _row(batch, with_fi=True):
    row = dict(batch=batch,
               rt=dict(eager_enqueue_us=17.5, layer_graph_enqueue_us=16.0, graph_enqueue_us=0.6, plan_us=80.0,
                       graph_gpu_us=12.0),
               pf=dict(eager_enqueue_us=18.0, layer_graph_enqueue_us=17.0, plan_us=90.0),
               inv=dict(graph_gpu_us=12.6))
    if with_fi:
        row["fi"] = dict(eager_enqueue_us=30.0, graph_enqueue_us=1.0, plan_us=400.0, plan_host_us=160.0,
                         pf_plan_us=180.0, pf_plan_host_us=150.0)
        row["plan_interleaved"], row["pf_plan_interleaved"] = dict(ratio=0.22), dict(ratio=0.48)
    return row


def test_summary_fits_a_tail_and_holds_every_target(capsys):
    bench.summary([_row(b) for b in (1, 4, 16, 64, 256)] + [_row(512, with_fi=False)])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) <= 40 and len(out) < 3000
    assert all(h in out for h in ("eager", "dg.step", "stepgr", "FI eager", "rt/FI", "pf/FIpf", "inv/auto"))
    b16 = next(x.split() for x in lines if x.split()[:1] == ["16"] and "0.20" in x)
    # rt/FI, rt/FI-h, pf/FIpf, pf/FIpf-h, inv/auto; the interleaved rt/FI~ and pf/FIpf~
    assert b16[-7:] == ["0.20", "0.50", "0.50", "0.60", "1.05", "0.22", "0.48"]
    assert any(x.split()[:1] == ["512"] and x.split().count("-") >= 4 for x in lines)   # no FlashInfer: dashes
