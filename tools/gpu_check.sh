#!/usr/bin/env bash
# One call on a GPU machine (offline; cuda-bindings, numpy, jinja2, rich,
# pytest, and optionally torch/cupy preinstalled):
#   bash tools/gpu_check.sh [--no-sanitize | --sanitize-only] [extra command ...]
# installs rtattn in place, runs the GPU tier, runs the extra command (e.g. a
# benchmark), runs compute-sanitizer's memcheck, racecheck, initcheck and
# synccheck over small smoke cases of each family (decode, prefill on both kernels, cascade),
# and prints a per-file pass/fail table and the sanitizer error counts LAST.
# --no-sanitize skips the sanitizers; --sanitize-only runs only them.
# PYTEST_ARGS (e.g. "-n 8", pytest-xdist) is passed to the GPU tier; tests marked `serial`
# (they read device-wide state such as free memory) then run alone afterwards.
# SAN_PARALLEL=1 runs the sanitizers beside the GPU tier (both only check correctness), so
# the extra command (a benchmark) still runs on an otherwise idle GPU.
# Exit status: nonzero if the GPU tier, the extra command or a sanitizer failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
rm -f "$OUT/junit.xml" "$OUT/junit-serial.xml"
PY=${PYTHON:-python}
# One BLAS/OpenMP thread per process: xdist's workers each computing the float64 reference with
# a pool as wide as the machine (spinning OpenBLAS threads) slowed the tier several times over.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
SANITIZE=yes
case "${1:-}" in
    --no-sanitize) SANITIZE=no; shift ;;
    --sanitize-only) SANITIZE=only; shift ;;
esac
SAN_TOOLS=${SAN_TOOLS:-"memcheck racecheck initcheck synccheck"}
SAN_TIMEOUT=${SAN_TIMEOUT:-120}   # seconds per sanitizer pass (a timeout shows as exit 124)

echo "== nvidia-smi"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true

echo "== pip install --no-deps --no-build-isolation -e ."
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1; then
    cat "$OUT/pip.log"
    echo "gpu_check: install FAILED"
    exit 2
fi

# compute-sanitizer over the smoke sets (SETS below): one line per tool and set in $OUT/sanitizer.tsv
# ("tool set", exit status, errors from its summary line -- "ERROR SUMMARY: N errors", racecheck's
# "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)" -- or "none" if it printed none).
sanitize() {
    : > "$OUT/sanitizer.tsv"
    if [ "$SANITIZE" = no ]; then
        echo "== compute-sanitizer: skipped (--no-sanitize)"
    elif ! command -v compute-sanitizer > /dev/null; then
        echo "== compute-sanitizer: not on PATH, sanitizer passes skipped"
        echo "skipped: compute-sanitizer not on PATH" > "$OUT/sanitizer.tsv"
    else
        echo "== compute-sanitizer ($(compute-sanitizer --version 2>&1 | grep -o 'Version [^ ]*' | head -1))"
        SAN_FLAGS=(--print-limit 20)
        # Host API errors (e.g. cuGetProcAddress probing for entry points the driver lacks) are
        # not kernel findings and bury them: report device-side errors only, where supported.
        if compute-sanitizer --help 2>&1 | grep -q -- --report-api-errors; then
            SAN_FLAGS+=(--report-api-errors no)
        fi
        # name:command pairs, small cases of each kernel family (one process each): decode's two,
        # prefill on the wgmma, warp-specialized and mma.sync kernels (split KV and split rows among
        # them), cascade levels on prefill tiles, joined
        # (the default prefill kernel first: a stage limit cuts the last sets' racecheck)
        SETS=("prefill-ws:tools/smoke_prefill.py --tile ws 0 10 23"
              "decode:tools/smoke_decode.py --quick"
              "prefill:tools/smoke_prefill.py 0 10 23"
              "prefill-sync:tools/smoke_prefill.py --mma sync 0 10"
              "cascade:tools/smoke_cascade.py 0 14")
        for set in "${SETS[@]}"; do
            read -r -a SMOKE <<< "${set#*:}"
            # compile the kernels once outside the sanitizer (NVRTC under it is slow, and cached after)
            timeout "$SAN_TIMEOUT" "$PY" "${SMOKE[@]}" > "$OUT/sanitize-warmup-${set%%:*}.log" 2>&1 \
                || echo "(smoke warm-up of ${set%%:*} exit $?: see $OUT/sanitize-warmup-${set%%:*}.log)"
        done
        for tool in $SAN_TOOLS; do
            for set in "${SETS[@]}"; do
                name=${set%%:*}
                read -r -a SMOKE <<< "${set#*:}"
                log="$OUT/sanitize-$tool-$name.log"
                t0=$SECONDS
                timeout "$SAN_TIMEOUT" compute-sanitizer --tool "$tool" "${SAN_FLAGS[@]}" "$PY" "${SMOKE[@]}" > "$log" 2>&1
                rc=$?
                errors=$(grep -oE 'ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+' "$log" \
                         | tail -1 | grep -oE '[0-9]+$')
                printf '%s\t%s\t%s\t%s\n' "$tool $name" "$rc" "${errors:-none}" "$((SECONDS - t0))" >> "$OUT/sanitizer.tsv"
                echo "$tool $name: exit $rc, errors ${errors:-none (no summary line)}, $((SECONDS - t0)) s  ($log)"
                grep -m 5 -E '^========= (Invalid|Error|Race|Uninitialized|Barrier|Warning)' "$log" || true
            done
        done
    fi
}

san_pid=
if [ "${SAN_PARALLEL:-0}" = 1 ] && [ "$SANITIZE" = yes ]; then
    sanitize > "$OUT/sanitize.log" 2>&1 &
    san_pid=$!
fi

rc_tests=0
if [ "$SANITIZE" != only ]; then
    echo "== pytest -m gpu ${PYTEST_ARGS:-}"
    if [ -n "${PYTEST_ARGS:-}" ]; then
        # shellcheck disable=SC2086
        "$PY" -m pytest -m "gpu and not serial" -q -rfE -p no:cacheprovider ${PYTEST_ARGS} \
            --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
        rc_tests=${PIPESTATUS[0]}
        echo "== pytest -m 'gpu and serial'"
        "$PY" -m pytest -m "gpu and serial" -q -rfE -p no:cacheprovider \
            --junitxml="$OUT/junit-serial.xml" 2>&1 | tee -a "$OUT/pytest.log"
        rc=${PIPESTATUS[0]}
        [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || rc_tests=$rc
    else
        "$PY" -m pytest -m gpu -q -rA -p no:cacheprovider --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
        rc_tests=${PIPESTATUS[0]}
    fi
fi

if [ -n "$san_pid" ]; then
    wait "$san_pid"
    cat "$OUT/sanitize.log"
fi

rc_extra=0
if [ "$#" -gt 0 ]; then
    echo "== extra: $*"
    "$@" 2>&1 | tee "$OUT/extra.log"
    rc_extra=${PIPESTATUS[0]}
fi

[ -n "$san_pid" ] || sanitize

echo "== summary (GPU tier per test file, then the sanitizers)"
"$PY" - "$OUT/junit.xml" "$rc_tests" "$rc_extra" "$*" "$OUT/sanitizer.tsv" "$SANITIZE" <<'PY'
import sys, xml.etree.ElementTree as ET
from collections import defaultdict
path, rc_tests, rc_extra, extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
san_path, sanitize = sys.argv[5], sys.argv[6]
rows = defaultdict(lambda: [0, 0, 0])
failed = []
cases = []
for p in ([] if sanitize == "only" else [path, path.replace("junit.xml", "junit-serial.xml")]):
    try:
        cases += list(ET.parse(p).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as e:
        if p == path:
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
w = max([len(f) for f in rows] + [24])
if sanitize != "only":
    print(f"{'file':<{w}}  passed  failed  skipped")
tot = [0, 0, 0]
for f in sorted(rows):
    p, fl, s = rows[f]
    tot = [a + b for a, b in zip(tot, rows[f])]
    print(f"{f:<{w}}  {p:6d}  {fl:6d}  {s:7d}{'  <-- FAIL' if fl else ''}")
if sanitize != "only":
    print(f"{'TOTAL':<{w}}  {tot[0]:6d}  {tot[1]:6d}  {tot[2]:7d}")
san_ok = True
try:
    san = [line.rstrip("\n").split("\t") for line in open(san_path) if line.strip()]
except OSError:
    san = []
if sanitize == "no":
    print("sanitizers: skipped (--no-sanitize)")
elif san and len(san[0]) == 1:
    print(f"sanitizers: {san[0][0]}")
else:
    print(f"{'sanitizer (smoke cases)':<{w}}  errors  exit  seconds")
    for tool, rc, errors, sec in san:
        bad = errors != "0" or rc != "0"
        san_ok &= not bad
        print(f"{tool:<{w}}  {errors:>6}  {rc:>4}  {sec:>7}{'  <-- FAIL' if bad else ''}")
    print(f"sanitizers: {'PASS (0 errors in every tool)' if san and san_ok else 'FAIL'}")
    san_ok = san_ok and bool(san)
if sanitize != "only":
    print(f"GPU tier: {'PASS' if rc_tests == 0 else f'FAIL (pytest exit {rc_tests})'}")
if extra:
    print(f"extra command: {'PASS' if rc_extra == 0 else f'FAIL (exit {rc_extra})'}: {extra}")
sys.exit(0 if san_ok else 3)
PY
rc_san=$?
[ "$rc_tests" -eq 0 ] && [ "$rc_extra" -eq 0 ] && [ "$rc_san" -eq 0 ]
