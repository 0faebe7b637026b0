"""tools/demo_tp.py: its head split and page tables (CPU); its model logic on CPU torch with
stand-ins for CUDA and rtattn (where torch is installed); the demo itself on the GPU."""
from __future__ import annotations

import contextlib
import subprocess
import sys

import numpy as np
import pytest

from rtattn.plan.layout import validate_batch

import tool_module

_TOOLS = tool_module.TOOLS
demo_tp = tool_module.load("demo_tp")


def test_heads_split_into_whole_kv_groups():
    assert demo_tp.split_heads(32, 8, 1) == (32, 8)
    assert demo_tp.split_heads(32, 8, 4) == (8, 2)
    for world in (3, 16, 0):
        with pytest.raises(ValueError, match="ranks|at least one rank"):
            demo_tp.split_heads(32, 8, world)


def test_nvlink_multicast_is_off_before_torch_loads():
    import os
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_page_tables_grow_one_token_a_step_over_each_requests_own_pages():
    init = np.array([1, 15, 16, 17, 40])
    t = demo_tp.PageTables(init, steps=20, page_size=16, seed=3)
    owned = [set(p.tolist()) for p in t.pages]
    assert sum(map(len, owned)) == len(set().union(*owned)) == t.num_pages   # no page shared
    for step in range(21):   # the steps and the spare timing token
        page, slot, (kvp, idx, last) = t.append()
        lens = init + step + 1
        bt = validate_batch(None, kvp, idx, last, 16, num_pages=t.num_pages)
        assert (bt.kv_len == lens).all()
        for b in range(len(init)):
            pos = lens[b] - 1   # the new token: the last slot of the request's table
            assert page[b] == idx[kvp[b] + pos // 16] and slot[b] == pos % 16
            assert set(idx[kvp[b]:kvp[b + 1]].tolist()) <= owned[b]


def test_lengths_are_the_same_for_every_rank_and_within_bounds():
    cfg = demo_tp.Config(batch=64, min_len=100, max_len=900)
    a, b = demo_tp.init_lengths(cfg), demo_tp.init_lengths(cfg)
    assert (a == b).all() and a.min() >= 99 and a.max() <= 900 and len(set(a.tolist())) > 10


def test_main_refuses_a_split_that_does_not_divide(capsys):
    pytest.importorskip("torch")
    import torch
    if not torch.cuda.is_available():
        assert demo_tp.main(["--heads", "32/8"]) == 2   # says why on stderr
        assert "no CUDA device" in capsys.readouterr().err
        return
    with pytest.raises(SystemExit):
        demo_tp.main(["--heads", "32/6", "--simulate", "4"])


class _Event:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.25


class _RefWrapper:
    """BatchDecodeWrapper stand-in: float32 torch attention over the planned page table."""

    def __init__(self, hq, hk, D, ps, *, max_batch, max_pages, num_pages_pool=None, device=None, num_ctas=None):
        self.hq, self.hk, self.D, self.ps, self.num_ctas, self.table = hq, hk, D, ps, num_ctas or 66, None

    def plan(self, kv_indptr, kv_indices, last, qo_indptr=None, stream=None):
        validate_batch(None, kv_indptr, kv_indices, last, self.ps)
        self.table = (kv_indptr, kv_indices, last)

    def run(self, q, k, v, out=None, stream=None):
        import torch
        kvp, idx, last = self.table
        assert q.shape == (len(last), self.hq, self.D) and k.shape[1:] == (self.ps, self.hk, self.D)
        g, rows = self.hq // self.hk, []
        for b in range(len(last)):
            pages = torch.as_tensor(idx[kvp[b]:kvp[b + 1]], dtype=torch.long)
            n = (len(pages) - 1) * self.ps + int(last[b])
            kk, vv = (c[pages].reshape(-1, self.hk, self.D)[:n].float().repeat_interleave(g, 1) for c in (k, v))
            p = (torch.einsum("hd,lhd->hl", q[b].float(), kk) / self.D ** 0.5).softmax(-1)
            rows.append(torch.einsum("hl,lhd->hd", p, vv))
        o = torch.stack(rows).to(q.dtype)
        return o if out is None else out.copy_(o)


def _cpu_standins(setattr_):
    """CUDA and rtattn replaced by CPU stand-ins (torch, NCCL -> gloo, attention in float32)."""
    import torch
    import torch.distributed as dist
    import rtattn
    import rtattn.graphs
    real_device, real_gen, real_init = torch.device, torch.Generator, dist.init_process_group
    stream = type("S", (), {"cuda_stream": 0x5000, "synchronize": lambda self: None})
    for name, value in (("Event", _Event), ("Stream", lambda device=None: stream()),
                        ("stream", lambda s: contextlib.nullcontext()), ("set_device", lambda d: None),
                        ("synchronize", lambda d=None: None), ("is_available", lambda: True),
                        ("device_count", lambda: 2)):
        setattr_(torch.cuda, name, value)
    setattr_(torch, "device", lambda *a, **k: real_device("cpu"))
    setattr_(torch, "Generator", lambda device=None: real_gen())
    setattr_(dist, "init_process_group", lambda backend, **kw: real_init("gloo", **kw))
    setattr_(rtattn, "BatchDecodeWrapper", _RefWrapper)
    setattr_(rtattn, "SharedPlan", lambda ws: type("P", (), {
        "plan": lambda self, *t, streams=None: [w.plan(*t) for w in ws]})())
    setattr_(rtattn.graphs, "DecodeGraphs", lambda w: type("G", (), {
        "step": lambda self, *a, **k: w.run(*a, **k)})())


SMALL = ["--heads", "8/4", "--head-dim", "64", "--batch", "4", "--layers", "2", "--steps", "4", "--max-len", "64"]


def test_the_demo_model_and_checks_on_cpu_torch(monkeypatch, capsys):
    """The demo's model, split, reductions and checks, with CUDA and rtattn replaced by CPU
    stand-ins (attention in float32 by torch): the simulated 2-way split and the world-1 NCCL run
    (gloo here) pass; a broken split (rank 1 given rank 0's heads) fails the check."""
    pytest.importorskip("torch")
    _cpu_standins(monkeypatch.setattr)
    assert demo_tp.main(["--simulate", "2", "--world", "1"] + SMALL) == 0
    text = capsys.readouterr().out
    assert "simulated split: 2 ranks" in text and "vs the one-GPU run" in text and "all checks passed" in text
    assert "FAIL" not in text
    wrong = demo_tp.RankModel.__init__

    def rank_zero_heads(self, torch, cfg, rank, world, *a, **k):
        wrong(self, torch, cfg, 0, world, *a, **k)   # every rank computes rank 0's heads
    monkeypatch.setattr(demo_tp.RankModel, "__init__", rank_zero_heads)
    assert demo_tp.run_simulated(demo_tp.Config(layers=2, steps=3, batch=4, heads=(8, 4), head_dim=64,
                                                max_len=64), 2) is False
    assert "FAIL" in capsys.readouterr().out


def _rank_on_cpu(rank, world, cfg, rdzv, result):
    _cpu_standins(setattr)
    demo_tp.rank_main(rank, world, cfg, rdzv, result)


def test_two_ranks_over_gloo_on_cpu_torch(tmp_path, capfd):
    """The world > 1 path (one process per rank: all-reduces, gathers, barriers, the report) with
    the CPU stand-ins in each rank process."""
    pytest.importorskip("torch")
    import torch.multiprocessing as mp
    cfg = demo_tp.Config(layers=2, steps=4, batch=4, heads=(8, 4), head_dim=64, max_len=64)
    result = tmp_path / "result"
    mp.spawn(_rank_on_cpu, args=(2, cfg, str(tmp_path / "rdzv"), str(result)), nprocs=2, join=True)
    out = capfd.readouterr().out
    assert result.read_text().strip() == "PASS", out
    assert "TP decode: world 2" in out and "(4/2 per rank)" in out and "imbalance across ranks" in out


@pytest.mark.gpu
def test_gpu_demo_tp_simulated_split_and_every_visible_gpu():
    res = subprocess.run([sys.executable, str(_TOOLS / "demo_tp.py"), "--simulate", "2", "--steps", "6",
                          "--layers", "2"], capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "demo_tp: all checks passed" in out, out
