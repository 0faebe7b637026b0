#!/usr/bin/env bash
# One GPU call for batch-invariant mode (issue 14), bounded stage by stage; logs under $OUT:
#   KCACHE=.kcache.tgz bash tools/gpu_invariant.sh   # a CUBIN cache built here (rtattn-compile), carried packed
# install; warm the bf16 decode kernels (auto and batch-invariant) with rtattn-compile, ~40 s on 16 cores (a
# carried cache makes this a read); smoke: each decode_cases.INVARIANT_CASES entry in its own process (error
# vs float64, request 0's bits alone / among short / among all requests); the invariance GPU tests;
# bench_decode (--quick --new, auto vs batch-invariant at the default chunk and at 256);
# bench_overhead (batch 1/16/64/256, KV ~1024). Compact results last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
T0=$SECONDS
stage() { echo "== $1 (at $((SECONDS - T0)) s)"; }

source tools/kcache.sh   # KCACHE: a carried CUBIN cache, so the device compiles nothing

stage install
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1; then
    cat "$OUT/pip.log"; exit 2
fi

stage "warm kernels"   # (the filter takes the bf16 prefill instances too: a read with a carried cache)
timeout "${WARM_S:-120}" "$PY" -m rtattn.cli.compile --arch sm_90 --filter bfloat16_d 2>&1 | tail -n 1

stage "smoke --invariant"
timeout "${SMOKE_S:-90}" "$PY" tools/smoke_decode.py --invariant > "$OUT/smoke_invariant.log" 2>&1
echo "smoke exit $?"

stage "GPU tests (invariance)"
timeout "${TESTS_S:-90}" "$PY" -m pytest -q -m gpu tests/test_decode.py -k "invariant or plan_modes" \
    -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"

stage bench_decode
timeout "${BENCH_S:-100}" "$PY" tools/bench_decode.py --quick --new --no-flashinfer --samples 20 --warm 1 \
    --deadline "${BENCH_DEADLINE_S:-90}" --rt-modes ${RT_MODES:-auto batch-invariant batch-invariant+c256} \
    > "$OUT/bench_decode.log" 2>&1
echo "bench_decode exit $?"

stage bench_overhead
timeout "${OVERHEAD_S:-60}" "$PY" tools/bench_overhead.py --batches 1,16,64,256 --no-flashinfer --reps ${OVERHEAD_REPS:-3} \
    > "$OUT/bench_overhead.log" 2>&1
echo "bench_overhead exit $?"

stage done
echo "---- smoke (batch-invariant)"; grep -E "^(ok |BAD|ERR)" "$OUT/smoke_invariant.log"
echo "---- bench_overhead"; grep -A7 -E "^µs per layer, wall" "$OUT/bench_overhead.log"
echo "---- pytest"; grep -E "passed|failed|error" "$OUT/pytest.log" | tail -n 5
echo "---- bench_decode"; tail -n 40 "$OUT/bench_decode.log"
