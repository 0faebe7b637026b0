#!/usr/bin/env bash
# One GPU call for batch-invariant mode (issue 14), bounded stage by stage; logs under $OUT:
#   KCACHE=.kcache.tgz bash tools/gpu_invariant.sh   # a CUBIN cache built here (rtattn-compile), carried packed
# install; warm the bf16 decode kernels (auto and batch-invariant) in parallel, ~40 s on 16 cores (a carried
# cache makes this a read); smoke: each decode_cases.INVARIANT_CASES entry in its own process (error
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

stage "warm kernels"
timeout "${WARM_S:-120}" "$PY" - <<'PY' 2>&1 | tail -n 3
import os, time
from concurrent.futures import ProcessPoolExecutor
from rtattn.families.decode import shipped as shipped_specs
from rtattn.runtime.nvrtc import _toolchain_id

def one(uri):
    from rtattn.kernels import compile_spec
    t = time.perf_counter()
    compile_spec(next(s for s in shipped_specs("sm_90") if s.uri == uri), "sm_90", quiet=True)
    return time.perf_counter() - t

uris = [s.uri for s in shipped_specs("sm_90") if "bfloat16_d" in s.uri]
t = time.perf_counter()
with ProcessPoolExecutor(os.cpu_count()) as pool:
    took = list(pool.map(one, uris))
print(f"{len(uris)} decode instances in {time.perf_counter() - t:.1f} s (slowest {max(took):.1f} s); "
      f"toolchain {_toolchain_id()}")
PY

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
