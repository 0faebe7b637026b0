#!/usr/bin/env bash
# The prefill family's GPU evidence in one device call, each stage under its own time limit:
#   1. isolated smoke (tools/smoke_prefill.py, one process per case) while FlashInfer's fa2
#      prefill JIT module builds on the CPU;
#   2. tools/bench_prefill.py on BENCH_ROWS with BENCH_LIBS and the tile A/B in RT_TILES;
#   3. optionally (TIER=1) the prefill GPU tier, and (DECODE=1) the decode tier + bench_decode --quick.
# Logs under $LOGS, packed into $OUT/logs.tgz after every stage; a compact table last.
#   PEER_DIR=$PWD/.peer bash tools/gpu_prefill.sh          # carry .peer (FlashInfer wheels)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/gpu_prefill}
mkdir -p "$OUT" "$LOGS"
PY=${PYTHON:-python3}
T_SMOKE=${T_SMOKE:-60} T_BENCH=${T_BENCH:-120} T_TIER=${T_TIER:-120}
BENCH_ROWS=${BENCH_ROWS:-"16x1024 4x4096 32x512 1x16384 chunk16x4096+512 8x2048-softcap 8x2048-alibi 8x2048-window mtd64x4096-q4"}
BENCH_LIBS=${BENCH_LIBS:-"rt fa2"}
RT_TILES=${RT_TILES:-}
declare -a SUMMARY

stage() {   # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 40 "$LOGS/$name.log"
    SUMMARY+=("$(printf '%-16s exit %3d  %4d s' "$name" "$rc" "$((SECONDS - t0))")")
    tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
}

"$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$LOGS/pip.log" 2>&1 \
    || { cat "$LOGS/pip.log"; echo "gpu_prefill: install FAILED"; exit 2; }
PEER_DIR=${PEER_DIR:-$PWD/.peer} source tools/peer_setup.sh > "$LOGS/peer.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
echo "commit: ${COMMIT:-unknown}"

# fa2's JIT module builds (CPU) while the smoke runs.
timeout 200 "$PY" tools/bench_prefill.py --libs fa2 --rows 32x512 --samples 2 > "$LOGS/fi-prebuild.log" 2>&1 &
stage smoke-prefill "$T_SMOKE" bash -c "for i in \$(seq 0 23); do timeout $((T_SMOKE - 5)) $PY tools/smoke_prefill.py \$i & done; wait"
grep -h -E "^(ok |BAD|EXC)" "$LOGS/smoke-prefill.log" | cut -c1-3 | sort | uniq -c
grep -h -E "^(BAD|EXC)" -A3 "$LOGS/smoke-prefill.log" | head -20
wait

# shellcheck disable=SC2086
stage bench-prefill "$T_BENCH" "$PY" tools/bench_prefill.py --libs $BENCH_LIBS --budget-s "$((T_BENCH - 25))" \
    --samples "${SAMPLES:-10}" --json "$LOGS/bench_prefill.json" --rows $BENCH_ROWS ${RT_TILES:+--rt-tiles $RT_TILES}
if [ "${TIER:-0}" = 1 ]; then
    XD=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
    stage tier-prefill "$T_TIER" "$PY" -m pytest -q -m gpu $XD tests/test_prefill.py tests/test_prefill_wrapper.py
fi
if [ "${DECODE:-0}" = 1 ]; then
    stage tier-decode "$T_TIER" "$PY" -m pytest -q -m gpu $XD tests/test_decode.py
    stage bench-decode 60 "$PY" tools/bench_decode.py --quick --deadline 40
fi
echo "== gpu_prefill summary"
printf '%s\n' "${SUMMARY[@]}"
grep -E "^\S+ +rt|geomean" "$LOGS/bench-prefill.log" | cut -c1-200
