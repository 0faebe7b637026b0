"""Fuzz wrapper.plan with random, mostly malformed page tables (no GPU: the fake one of tests/).

    python tools/fuzz_plan.py [--cases 100000] [--seed 0] [--show 10]

Prints the counts (valid, invalid, failures, invalid tables accepted) and the first failures;
exit 1 on any failure. A failure is an invalid table accepted, a refusal that is not a
ValueError/TypeError naming a broken array or bound, a valid table refused, or an accepted
plan that fails verify_plan or disagrees with the table (tests/plan_fuzz.py has the rules).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=10, help="failures printed in full")
    a = ap.parse_args(argv)
    import pytest

    import plan_fuzz
    shown = []

    def on_failure(i, args, kwargs, err):
        if len(shown) < a.show:
            shown.append(f"case {i}: {err}\n    args={[repr(x)[:200] for x in args]} kwargs={kwargs}")

    t = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        s = plan_fuzz.fuzz(mp, a.cases, seed=a.seed, on_failure=on_failure)
    print("\n".join(shown))
    print(f"fuzz_plan: {s['cases']} cases (seed {a.seed}): {s['valid']} valid, {s['invalid']} invalid; "
          f"{s['failures']} failures, {s['invalid_accepted']} invalid tables accepted "
          f"({time.perf_counter() - t:.1f} s)")
    return 1 if s["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
