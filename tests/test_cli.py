"""Both CLIs on bad arguments and inputs: one line on stderr, exit status 2, no traceback; their
tables fit the terminal; --help shows defaults and says the default workload is synthetic."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rtattn.cli import compile as compile_cli
from rtattn.cli import inspect as inspect_cli


def _one_line_error(capsys, main, argv, match):
    assert main(argv) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rtattn-") and match in lines[0], cap.err
    assert "Traceback" not in cap.err and cap.out == ""


def _write(tmp_path, name, content):
    p = tmp_path / name
    if name.endswith(".npz"):
        np.savez(p, **content)
    else:
        p.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(p)


@pytest.mark.parametrize("argv, match", [
    (["--kv-dist", "poisson:3"], "expected const:N, uniform:A:B"),
    (["--kv-dist", "const:-5"], "lengths must be >= 0"),
    (["--kv-dist", "zipf:0"], "MEAN >= 1"),
    (["--kv-dist", "uniform:9:3"], "A <= B"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--batch", "x"], "invalid int value"),
    (["--qo-len", "0"], "--qo-len must be >= 1"),
    (["--heads", "32/0"], "head counts must be positive"),
    (["--heads", "30/8"], "not a multiple"),
    (["--heads", "x"], "expected H_qo/H_kv"),
    (["--head-dim", "100"], "head_dim=100 is not supported"),
    (["--page-size", "3"], "power of two"),
    (["--mode", "fast"], "invalid choice"),
    (["--chunk-tokens", "0"], "chunk_tokens must be >= 1"),
    (["--lengths", "/nonexistent/lens.json"], "cannot read it"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_inspect_bad_arguments(capsys, argv, match):
    _one_line_error(capsys, inspect_cli.main, argv + ["--reps", "1"], match)


@pytest.mark.parametrize("name, content, match", [
    ("a.json", {"qo_lens": [1]}, "needs 'kv_lens'"),
    ("b.json", [], "non-empty list"),
    ("c.json", [10, 2.5], "lengths must be integers"),
    ("d.json", [10, -1], "[1] = -1: lengths must be >= 0"),
    ("e.json", "{not json", "cannot read it"),
    ("f.json", {"kv_lens": [5, 6], "qo_lens": [1]}, "qo_lens has 1 entries"),
    ("g.npz", {"lens": np.arange(3)}, "needs 'kv_lens'"),
    ("h.npz", {"kv_lens": np.array([1.0, 2.0])}, "lengths must be integers"),
    ("i.json", [[1, 2], [3, 4]], "non-empty list"),
])
def test_inspect_bad_lengths_files(capsys, tmp_path, name, content, match):
    _one_line_error(capsys, inspect_cli.main, ["--lengths", _write(tmp_path, name, content), "--reps", "1"],
                    match)


def test_inspect_states_the_workload_and_the_mode_auto_chose(capsys):
    assert inspect_cli.main(["--json", "--reps", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["mode"] == "auto" and r["mode_used"] in ("balanced", "contiguous")
    assert r["workload"].startswith("synthetic: 64 requests")
    assert inspect_cli.main(["--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert f"mode auto chose {r['mode_used']}" in out and "workload synthetic" in out


def _cli(*argv, columns=80):
    env = dict(os.environ, COLUMNS=str(columns), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("args", [[], ["--heads", "8/1", "--batch", "512"]])   # 33 and 264 CTAs
def test_inspect_fits_80_columns(args):
    p = _cli("rtattn.cli.inspect", "--reps", "1", *args)
    assert p.returncode == 0, p.stderr
    widths = [len(line) for line in p.stdout.splitlines()]
    assert max(widths) <= 80
    bars = [line for line in p.stdout.splitlines() if "█" in line]
    assert len(bars) >= 10 and max(line.count("█") for line in bars) >= 10   # bars did not collapse


def test_help_shows_defaults_and_the_synthetic_default():
    p = _cli("rtattn.cli.inspect", "--help", columns=100)
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    assert "SYNTHETIC" in text and "(default: zipf:1024)" in text and "(default: 64)" in text


def test_errors_are_one_line_at_the_process_level(tmp_path):
    for argv, match in [(("rtattn.cli.inspect", "--lengths", str(tmp_path / "none.json")), "cannot read it"),
                        (("rtattn.cli.compile", "--arch", "bogus"), "expected a real GPU architecture")]:
        p = _cli(*argv)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and match in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.parametrize("argv, match", [
    (["--arch", "bogus"], "expected a real GPU architecture"),
    (["--arch", "sm_75"], "the kernels need sm_80 or newer"),
    (["--arch", "sm_90", "--filter", "no_such_kernel"], "matches no kernel instance"),
    (["--arch", "sm_90", "--jobs", "0"], "--jobs must be >= 1"),
    (["--archh", "sm_90"], "unrecognized arguments"),
])
def test_compile_bad_arguments(capsys, argv, match):
    _one_line_error(capsys, compile_cli.main, argv, match)


def test_compile_check_arch_is_the_kernels_rule():
    from rtattn.kernels import check_arch
    assert check_arch("sm_90a") == "sm_90a" and check_arch("sm_100") == "sm_100"
    for bad in ("sm_75", "compute_90", "90", None):
        with pytest.raises(ValueError, match="arch"):
            check_arch(bad)


# ------------------------------------------------------------ prefill in both CLIs
def test_inspect_prefill_shows_its_tile_and_the_blocks_its_mask_skips(capsys):
    argv = ["--kernel", "prefill", "--causal", "--qo-len", "512", "--batch", "4", "--kv-dist", "const:2048",
            "--reps", "1"]
    assert inspect_cli.main(argv + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kernel"] == "prefill" and r["family_choice"].startswith("prefill: forced")
    assert r["tile"]["rows"] == 128 and r["tile"]["q"] == 32 and r["tile"]["kv"] == 32   # the sm_90 wgmma tile
    assert r["planned_kv_tokens"] < r["unmasked_kv_tokens"]   # causal: the hidden blocks are not planned
    assert inspect_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "prefill kernel" in out and "mask skip" in out and "T_q 32 tokens = 128 rows" in out


@pytest.mark.parametrize("qo, want", [("1", "decode"), ("512", "prefill")])
def test_inspect_default_family_is_the_cost_rules(capsys, qo, want):
    assert inspect_cli.main(["--qo-len", qo, "--kv-dist", "const:1024", "--reps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kernel"] == want and r["family_choice"].startswith(want)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_warms_every_shipped_prefill_instance(arch):
    from rtattn.families import prefill
    names = [n for kind, n, _ in compile_cli.shipped_jobs(arch) if kind == "prefill"]
    assert names == [prefill.instance_name(s, t) for s, t in prefill.shipped(arch)] and len(names) >= 20
    assert all("prefill" in n for n in names)
    assert [k for k, _, _ in compile_cli.shipped_jobs(arch, "prefill")] == ["prefill"] * len(names)


def test_compile_builds_a_prefill_instance_into_the_cache(capsys, isolated_cache):
    from rtattn.families import prefill
    name = prefill.instance_name(*prefill.shipped("sm_90")[1])
    assert compile_cli.main(["--arch", "sm_90", "--filter", name, "--jobs", "1"]) == 0
    assert "1 instances for sm_90" in capsys.readouterr().out
    assert any(isolated_cache.rglob("*.bin")) or any(p.is_file() for p in isolated_cache.rglob("*"))
