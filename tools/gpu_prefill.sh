#!/usr/bin/env bash
# The prefill family's GPU evidence in one device call, each stage under its own time limit:
#   1. isolated smoke (tools/smoke_prefill.py, one process per case) while FlashInfer's prefill
#      JIT modules (fa2 per variant, fa3 causal) build in the background;
#   2. (TIER=1) the prefill GPU tier;
#   3. tools/bench_prefill.py: BENCH_ROWS x BENCH_LIBS (the rt/fa2 table), then BENCH2_ROWS x
#      BENCH2_LIBS with the tile A/B in BENCH2_TILES (fa3, torch SDPA; skipped if empty);
#   4. (DECODE=1) the decode tier + bench_decode --quick (after a change to a header decode uses).
# Logs under $LOGS, packed into $OUT/logs.tgz after every stage; compact tables last.
#   PEER_DIR=$PWD/.peer COMMIT=$(git rev-parse --short HEAD) TIER=1 bash tools/gpu_prefill.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/gpu_prefill}
mkdir -p "$OUT" "$LOGS"
PY=${PYTHON:-python3}
T_SMOKE=${T_SMOKE:-60} T_BENCH=${T_BENCH:-120} T_BENCH2=${T_BENCH2:-60} T_TIER=${T_TIER:-120}
BENCH_ROWS=${BENCH_ROWS:-"16x1024 4x4096 32x512 1x16384 chunk16x4096+512 8x2048-softcap 8x2048-alibi 8x2048-window mtd64x4096-q4"}
BENCH_LIBS=${BENCH_LIBS:-"rt fa2"}
RT_TILES=${RT_TILES:-}
BENCH2_ROWS=${BENCH2_ROWS:-"16x1024 4x4096 32x512 1x16384"}
BENCH2_LIBS=${BENCH2_LIBS:-"rt fa3 sdpa sdpa-flash"}
BENCH2_TILES=${BENCH2_TILES:-"default q128_kv32_w8_s3"}
declare -a SUMMARY

stage() {   # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 30 "$LOGS/$name.log"
    SUMMARY+=("$(printf '%-16s exit %3d  %4d s' "$name" "$rc" "$((SECONDS - t0))")")
    tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
}

"$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$LOGS/pip.log" 2>&1 \
    || { cat "$LOGS/pip.log"; echo "gpu_prefill: install FAILED"; exit 2; }
PEER_DIR=${PEER_DIR:-$PWD/.peer} source tools/peer_setup.sh > "$LOGS/peer.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
echo "commit: ${COMMIT:-unknown}"

# FlashInfer's JIT modules build (CPU) while the smoke and the tier run: one module per variant.
prebuild() { timeout 200 "$PY" tools/bench_prefill.py --samples 2 --libs "$@" > "$LOGS/fi-prebuild-$1-$3.log" 2>&1; }
prebuild fa2 --rows 32x512 32x512-softcap &
prebuild fa2 --rows 32x512-alibi 32x512-window &
[ -n "$BENCH2_ROWS" ] && case " $BENCH2_LIBS " in *" fa3 "*) prebuild fa3 --rows 32x512 & ;; esac
stage smoke-prefill "$T_SMOKE" bash -c "for i in \$(seq 0 23); do timeout $((T_SMOKE - 5)) $PY tools/smoke_prefill.py \$i & done; wait"
grep -h -E "^(ok |BAD|EXC)" "$LOGS/smoke-prefill.log" | cut -c1-3 | sort | uniq -c
grep -h -E "^(BAD|EXC)" -A3 "$LOGS/smoke-prefill.log" | head -20
XD=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
if [ "${TIER:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    stage tier-prefill "$T_TIER" "$PY" -m pytest -q -m gpu $XD -p no:cacheprovider tests/test_prefill.py tests/test_prefill_wrapper.py
fi
wait

# shellcheck disable=SC2086
stage bench-prefill "$T_BENCH" "$PY" tools/bench_prefill.py --libs $BENCH_LIBS --budget-s "$((T_BENCH - 25))" \
    --samples "${SAMPLES:-10}" --json "$LOGS/bench_prefill.json" --rows $BENCH_ROWS ${RT_TILES:+--rt-tiles $RT_TILES}
if [ -n "$BENCH2_ROWS" ]; then
    # shellcheck disable=SC2086
    stage bench-prefill2 "$T_BENCH2" "$PY" tools/bench_prefill.py --libs $BENCH2_LIBS --budget-s "$((T_BENCH2 - 20))" \
        --samples "${SAMPLES:-10}" --json "$LOGS/bench_prefill2.json" --rows $BENCH2_ROWS --rt-tiles $BENCH2_TILES
fi
if [ "${DECODE:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    stage tier-decode "$T_TIER" "$PY" -m pytest -q -m gpu $XD tests/test_decode.py
    stage bench-decode 60 "$PY" tools/bench_decode.py --quick --deadline 40
fi
echo "== gpu_prefill summary"
printf '%s\n' "${SUMMARY[@]}"
for f in "$LOGS"/bench-prefill*.log; do [ -f "$f" ] && sed -n '/^rt\/fa2\|^row |/,$p' "$f"; done
