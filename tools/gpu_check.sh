#!/usr/bin/env bash
# One call on a GPU machine (offline; cuda-bindings, numpy, jinja2, rich,
# pytest, and optionally torch/cupy preinstalled):
#   bash tools/gpu_check.sh [extra command ...]
# installs rtattn in place, runs the GPU tier, runs the extra command (e.g. a
# benchmark), and prints a per-file pass/fail table LAST. Exit status: nonzero
# if the GPU tier or the extra command failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python}

echo "== nvidia-smi"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true

echo "== pip install --no-deps --no-build-isolation -e ."
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1; then
    cat "$OUT/pip.log"
    echo "gpu_check: install FAILED"
    exit 2
fi

echo "== pytest -m gpu"
"$PY" -m pytest -m gpu -q -rA -p no:cacheprovider --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
rc_tests=${PIPESTATUS[0]}

rc_extra=0
if [ "$#" -gt 0 ]; then
    echo "== extra: $*"
    "$@" 2>&1 | tee "$OUT/extra.log"
    rc_extra=${PIPESTATUS[0]}
fi

echo "== summary (GPU tier, per test file)"
"$PY" - "$OUT/junit.xml" "$rc_tests" "$rc_extra" "$*" <<'PY'
import sys, xml.etree.ElementTree as ET
from collections import defaultdict
path, rc_tests, rc_extra, extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = defaultdict(lambda: [0, 0, 0])
failed = []
try:
    cases = ET.parse(path).getroot().iter("testcase")
except (OSError, ET.ParseError) as e:
    cases = []
    print(f"(no junit xml: {e})")
for tc in cases:
    parts = (tc.get("classname") or "?").split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():  # drop test classes: module path remains
        parts.pop()
    f = "/".join(parts) + ".py"
    kind = 0
    if tc.find("failure") is not None or tc.find("error") is not None:
        kind = 1
        failed.append(f"{f}::{tc.get('name')}")
    elif tc.find("skipped") is not None:
        kind = 2
    rows[f][kind] += 1
for t in failed[:40]:  # failures first, the table last
    print(f"FAILED {t}")
if len(failed) > 40:
    print(f"... and {len(failed) - 40} more failures (see $OUT/pytest.log)")
w = max([len(f) for f in rows] + [10])
print(f"{'file':<{w}}  passed  failed  skipped")
tot = [0, 0, 0]
for f in sorted(rows):
    p, fl, s = rows[f]
    tot = [a + b for a, b in zip(tot, rows[f])]
    print(f"{f:<{w}}  {p:6d}  {fl:6d}  {s:7d}{'  <-- FAIL' if fl else ''}")
print(f"{'TOTAL':<{w}}  {tot[0]:6d}  {tot[1]:6d}  {tot[2]:7d}")
print(f"GPU tier: {'PASS' if rc_tests == 0 else f'FAIL (pytest exit {rc_tests})'}")
if extra:
    print(f"extra command: {'PASS' if rc_extra == 0 else f'FAIL (exit {rc_extra})'}: {extra}")
PY
[ "$rc_tests" -eq 0 ] && [ "$rc_extra" -eq 0 ]
