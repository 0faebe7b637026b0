"""rtattn-inspect --shared-prefix: the levels it shows are the planner's and add up."""
from __future__ import annotations

import json

from rtattn.cli.inspect import main


def test_shared_prefix_view_json(capsys):
    assert main(["--shared-prefix", "32768", "--groups", "4:512", "--batch", "64", "--kv-dist", "const:100",
                 "--reps", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["num_levels"] == 3 and [lv["groups"] for lv in r["levels"]] == [1, 4, 64]
    assert [lv["kv_tokens"] for lv in r["levels"]] == [32768, 4 * 512, 64 * 100]
    assert r["levels"][0]["kv_tokens_read"] == 2 * 32768   # 64 queries in two prefill tiles (KV split over CTAs)
    assert r["levels"][0]["prefill_items"] == r["levels"][0]["items"] >= 2 and r["prefill"]["tile_q"] == 32
    # 16 queries over 512 tokens a group saves too little on prefill tiles (the cost rule); 1 a request
    assert [lv["prefill_items"] for lv in r["levels"][1:]] == [0, 0]
    assert r["single_format_kv_tokens"] == 64 * (32768 + 512 + 100)
    assert sum(p["bytes"] for p in r["plan_set"]) == r["plan_set_bytes"]


def test_the_cost_rule_keeps_a_short_prefix_on_decode(capsys):
    assert main(["--shared-prefix", "1024", "--batch", "16", "--kv-dist", "const:100", "--reps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["levels"][0]["kv_tokens_read"] == 1024 * 2 and not any(lv["prefill_items"] for lv in r["levels"])


def test_decode_only_view(capsys):
    assert main(["--shared-prefix", "1024", "--batch", "16", "--kv-dist", "const:100", "--kernel", "decode",
                 "--reps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prefill"] is None and r["levels"][0]["kv_tokens_read"] == 1024 * 2   # 16 queries in decode tiles of 8
    assert not any(lv["prefill_items"] for lv in r["levels"])


def test_shared_prefix_view_renders(capsys):
    assert main(["--shared-prefix", "256", "--batch", "8", "--kv-dist", "const:40", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "cascade plan" in out and "fewer" in out and "fold_rows" in out and "prefill" in out


def test_bad_cascade_arguments_are_one_line(capsys):
    assert main(["--shared-prefix", "64", "--groups", "x", "--batch", "4"]) == 2
    assert capsys.readouterr().err.strip() == "rtattn-inspect: --groups 'x': expected GROUPS:TOKENS, e.g. 8:4096"
