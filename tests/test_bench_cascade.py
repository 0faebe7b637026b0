"""tools/bench_cascade.py's own check, on the CPU: its page tables and levels, its table and
verdict (a wrong output is marked FAIL and fails the run), and, where torch is installed, its
reference against rtattn's float64 reference and the float64 executor's cascade output."""
from __future__ import annotations

import pytest

import tool_module

bench_cascade = tool_module.load("bench_cascade")


def test_tables_and_verdict():
    assert bench_cascade.selftest(reference_checks=False) == 0


def test_reference_and_every_copy_checked():
    pytest.importorskip("torch")
    bench_cascade._selftest_reference()
