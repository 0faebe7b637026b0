#!/usr/bin/env bash
# The prefill softmax's opt-in builds on the GPU, in one device call (docs/perf-log.md "Session 17"):
#   FIXED (-DRTATTN_FIXED_SOFTMAX): a bf16 soft cap's logits weighed against a fixed reference, no row max
#   TC    (-DRTATTN_TC_ROWSUM):     the rows' weight sums on the tensor cores beside PV (wgmma kernels)
#   TREE  (-DRTATTN_TREE_SOFTMAX):  row max and sum as trees
# First the float64-reference GPU tests of each build (soft cap at both ends of the cap, the variants, the
# kernels), then bench_prefill per build (rt against fa2 in the same run), bench_overhead and the decode tier.
#   bash tools/gpu_softmax_ab.sh                       # carry .peer (and .kcache.tgz: tools/kcache.sh)
#   DEFS="none FIXED FIXED+TC" ROWS="32x512 32x512-softcap" bash tools/gpu_softmax_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
KCACHE=${KCACHE:-.kcache.tgz} source tools/kcache.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail /tmp/pip.log; exit 2; }
PEER_DIR=${PEER_DIR:-$PWD/.peer} source tools/peer_setup.sh > /tmp/peer.log 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | head -1
ROWS=${ROWS:-16x1024 4x4096 32x512 32x512-softcap 8x2048 8x2048-softcap}
DEFS=${DEFS:-none FIXED TC FIXED+TC}
defines() {   # "FIXED+TC" -> its -D flags
    local dd="" part
    for part in ${1//+/ }; do
        case $part in FIXED) dd="$dd -DRTATTN_FIXED_SOFTMAX" ;; TC) dd="$dd -DRTATTN_TC_ROWSUM" ;;
                      TREE) dd="$dd -DRTATTN_TREE_SOFTMAX" ;; none) ;; *) echo "unknown build $part" >&2; exit 2 ;; esac
    done
    echo "$dd"
}
timeout 300 python3 tools/bench_prefill.py --libs fa2 --rows $ROWS --samples 1 > /tmp/fa2pre.log 2>&1 &
PRE=$!
timeout 300 python3 tools/bench_decode.py --prebuild-fi --quick > /tmp/fidec.log 2>&1 &
t0=$SECONDS
for D in $DEFS; do
    [ "$D" = none ] && continue
    echo "== build $D: prefill kernels against the float64 reference ($((SECONDS - t0)) s)"
    RTATTN_DEV_DEFINES="$(defines "$D")" timeout ${T_TESTS:-120} python3 -m pytest -m gpu tests/test_prefill.py \
        -k "soft_cap_weights or test_variants or bias_and_cap or matches_reference" -q -n 8 -p no:cacheprovider 2>&1 | tail -3
done
wait $PRE; tail -1 /tmp/fa2pre.log
for D in $DEFS; do
    echo "== bench_prefill build $D ($((SECONDS - t0)) s)"
    RTATTN_DEV_DEFINES="$(defines "$D")" timeout ${T_BENCH:-90} python3 tools/bench_prefill.py --libs rt fa2 --rows $ROWS \
        --samples ${SAMPLES:-8} --json "$OUT/bp_$D.json" > "$OUT/bp_$D.log" 2>&1
    grep -v "^    " "$OUT/bp_$D.log" | tail -${TAILN:-18}
done
echo "== bench_overhead ($((SECONDS - t0)) s)"
timeout ${T_OVH:-80} python3 tools/bench_overhead.py --batches ${BATCHES:-8,12,256,4} --reps 9 > "$OUT/overhead.log" 2>&1
tail -32 "$OUT/overhead.log"
echo "== decode tier ($((SECONDS - t0)) s)"
timeout ${T_DECODE:-70} python3 -m pytest -m gpu tests/test_decode.py tests/test_graph.py -q -n 8 -p no:cacheprovider 2>&1 | tail -2
echo "== done ($((SECONDS - t0)) s)"
