#!/usr/bin/env bash
# The whole project's GPU evidence in one device call, most important first, each stage under
# its own time limit so a slow one cannot take the rest with it:
#   1. isolated smoke checks of the newest kernels (fp8 KV, prefill, cascade), one process per case;
#   2. the GPU tier (pytest-xdist) with the compute-sanitizers beside it (tools/gpu_check.sh),
#      while FlashInfer's JIT modules build on the CPU;
#   3. benchmarks against FlashInfer on an otherwise idle GPU: decode, prefill, the two families on
#      the family choice's rows (multi-token decode, wide groups), cascade, host path.
# Every log goes to $LOGS; a compact table is printed last and the logs are packed into
# $OUT/logs.tgz (the device tool brings back only a few files).
#   bash tools/gpu_all.sh            # carry .peer (FlashInfer wheels, tools/peer_setup.sh)
#   ONLY="gpu-tier bench-decode" BENCH_DECODE_ARGS="--rows *" bash tools/gpu_all.sh   # a subset
#   KCACHE=.kcache.tgz bash tools/gpu_all.sh   # a CUBIN cache built here (rtattn-compile), carried packed
#     (tools/kcache_pack.py); KCACHE_BACK=1 returns what the device compiled beside it ($OUT/kcache-new.tgz)
#   OVERHEAD_BATCHES=1,4,16,64,256 ...        # bench_overhead's batches (4: where auto weighs both partitions)
#   INVARIANT_MODES="auto batch-invariant batch-invariant+c256" ...   # bench-invariant's --rt-modes
#   CASCADE_LIBS=rt-casc,rt-wg,fi-casc PREFILL_TILES="default x" ...   # bench_cascade's libs (CASCADE_ARGS=--breakdown), bench_prefill's tile A/B
#   PREFILL_SHAPES="32:8:64:16 ..." PREFILL_SHAPE_ROWS="16x1024 ..."   # bench-prefill-shapes' neighbourhood (HQ:HKV:D:PAGE)
#   PREFILL_QUEUE_ORDERS="lpt request" ...   # bench-prefill-shapes' plan queue orders (rt, rt+request) A/B
#   FUZZ_BASE=2000 FUZZ_PROCS=12 T_FUZZ=150 ... # the fuzz stage's seeds (tools/fuzz_gpu.py: random workloads vs float64)
#   ONLY=nbhd bash tools/gpu_all.sh          # the neighbourhood alone, ~8 min at most (docs/perf-log.md "Neighbourhood"):
#     nbhd-tier (pytest -m gpu -k nbhd: groups 3/5/6/7, pages 2/4/128), nbhd-decode (bench_decode --nbhd),
#     nbhd-cascade (bench_cascade --rows 'nb-*'), nbhd-prefill (bench_prefill --shapes nbhd); only when ONLY names
#     them (or "nbhd"); T_NBHD_TIER / T_NBHD_BENCH their limits, NBHD_PREFILL_SHAPES / NBHD_PREFILL_ROWS the prefill set
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# One BLAS / OpenMP thread per process: the smoke stages run one process per case, each with a
# float64 reference (machine-wide spinning pools in each slowed them several times; gpu_check.sh too)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/gpu_all}
mkdir -p "$OUT" "$LOGS"
PY=${PYTHON:-python3}
T_SMOKE=${T_SMOKE:-60} T_TIER=${T_TIER:-300} T_BENCH=${T_BENCH:-90}
T_NBHD_TIER=${T_NBHD_TIER:-150} T_NBHD_BENCH=${T_NBHD_BENCH:-110}
T_FUZZ=${T_FUZZ:-150} FUZZ_PROCS=${FUZZ_PROCS:-12} FUZZ_BASE=${FUZZ_BASE:-1000}
case " ${ONLY:-} " in *" nbhd "*) ONLY="$ONLY nbhd-tier nbhd-decode nbhd-cascade nbhd-prefill" ;; esac   # the group
declare -a SUMMARY
read -r -a BD_ARGS <<< "${BENCH_DECODE_ARGS:---quick --fp8}"   # word-split, never glob-expanded

stage() {   # stage NAME LIMIT_S COMMAND...: run it, log it, remember its exit status and time
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    case " ${ONLY:-$name} " in *" $name "*) ;; *) return 0 ;; esac   # ONLY="a b": just those stages
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 25 "$LOGS/$name.log"
    SUMMARY+=("$(printf '%-16s exit %3d  %4d s' "$name" "$rc" "$((SECONDS - t0))")")
    printf '%s\n' "${SUMMARY[@]}" > "$LOGS/summary.txt"
    tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null   # after every stage: a killed call still brings them back
}

source tools/kcache.sh   # KCACHE: a carried CUBIN cache, so the device compiles nothing
"$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$LOGS/pip.log" 2>&1 \
    || { cat "$LOGS/pip.log"; echo "gpu_all: install FAILED"; exit 2; }
PEER_DIR=${PEER_DIR:-$PWD/.peer} source tools/peer_setup.sh > "$LOGS/peer.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1

# FlashInfer's JIT builds (CPU) overlap stages 1-2 (fa3's prefill module takes ~90 s); none of these when ONLY
# names only neighbourhood stages (their own builds are below: the wait after the tier must stay short).
NB_ONLY=
[ -n "${ONLY:-}" ] && [ -z "$(printf '%s\n' $ONLY | grep -v '^nbhd')" ] && NB_ONLY=1
[ -n "$NB_ONLY" ] || timeout 300 "$PY" tools/bench_decode.py --prebuild-fi "${BD_ARGS[@]}" > "$LOGS/fi-prebuild.log" 2>&1 &
case " ${ONLY:-bench-prefill} " in *" bench-prefill "*|*" bench-overhead "*)   # fa2's JIT builds beside the first stages
    # (causal, soft-cap, ALiBi and window modules; bench-overhead times fa2's prefill plan() on its
    # prefill rows: the causal module)
    timeout 300 "$PY" tools/bench_prefill.py --libs fa2 --rows 32x512 32x512-softcap 32x512-alibi 8x2048-window --samples 2 > "$LOGS/fi-prebuild-fa2.log" 2>&1 & ;;
esac
case " ${ONLY:-bench-prefill-shapes} " in *" bench-prefill-shapes "*)   # fa2's d64 / d256 modules
    timeout 300 "$PY" tools/bench_prefill.py --libs fa2 --shapes 32:8:64:16 32:8:256:16 --rows 32x512 --samples 1 > "$LOGS/fi-prebuild-shapes.log" 2>&1 & ;;
esac
case " ${ONLY:-bench-prefill-peers} " in *" bench-prefill-peers "*)
    timeout 300 "$PY" tools/bench_prefill.py --libs fa3 --rows 32x512 --samples 2 > "$LOGS/fi-prebuild-fa3.log" 2>&1 & ;;
esac
# The neighbourhood's stages run only when ONLY names them; their FlashInfer modules build beside nbhd-tier:
# decode cc/tc of the n-* rows (d64, d256 + soft-cap), fa2's causal d64 / d128 / d256 (unless a stage above builds them).
case " ${ONLY:-} " in *" nbhd-decode "*)
    timeout 300 "$PY" tools/bench_decode.py --prebuild-fi --nbhd > "$LOGS/fi-prebuild-nbhd.log" 2>&1 & ;;
esac
case " ${ONLY:-} " in *" bench-prefill "*|*" bench-overhead "*|*" bench-prefill-shapes "*) ;; *" nbhd-prefill "*)
    timeout 300 "$PY" tools/bench_prefill.py --libs fa2 --shapes 32:8:64:16 32:8:128:16 32:8:256:16 --rows 32x512 --samples 1 \
        > "$LOGS/fi-prebuild-nbhd-fa2.log" 2>&1 & ;;
esac

last_case() {   # last_case SCRIPT: the index of tools/SCRIPT.py's last smoke case (its CASES), one process per case
    "$PY" -c "import sys; sys.path.insert(0, 'tools'); import $1; print(len($1.CASES) - 1)"
}
PF_LAST=$(last_case smoke_prefill) CASC_LAST=$(last_case smoke_cascade)

stage smoke-fp8 "$T_SMOKE" "$PY" tools/smoke_decode.py --fp8 --no-timing
stage smoke-prefill "$T_SMOKE" bash -c "for i in \$(seq 0 $PF_LAST); do timeout 60 $PY tools/smoke_prefill.py \$i & done; wait"
grep -h -E "^(ok |BAD|EXC)" "$LOGS/smoke-prefill.log" | sort | uniq -c | sort -rn | head -5
stage smoke-prefill-alt "$((T_SMOKE + 45))" bash -c "for m in '--mma sync' '--tile ws' '--cross' '--mma sync --cross'; do \
    for i in \$(seq 0 $PF_LAST); do timeout 60 $PY tools/smoke_prefill.py \$m \$i & done; wait; done"   # the other kernels, the KV stream across items
grep -h -E "^(ok |BAD|EXC)" "$LOGS/smoke-prefill-alt.log" | sort | uniq -c | sort -rn | head -5
stage smoke-cascade "$((T_SMOKE + 40))" bash -c "for i in \$(seq 0 $CASC_LAST); do timeout 90 $PY tools/smoke_cascade.py \$i & done; wait"
grep -h -E "^(ok |BAD|EXC)" "$LOGS/smoke-cascade.log" | sort | uniq -c | sort -rn | head -5
stage smoke-invariant "$((T_SMOKE + 30))" "$PY" tools/smoke_decode.py --invariant
# Random workloads against float64 (tools/fuzz_gpu.py), FUZZ_PROCS processes of 20 seeds from FUZZ_BASE
stage fuzz "$((T_FUZZ + 40))" bash -c "for i in \$(seq 0 $((FUZZ_PROCS - 1))); do s=\$(($FUZZ_BASE + i * 20)); \
    timeout $((T_FUZZ + 30)) $PY tools/fuzz_gpu.py --seeds \$s:\$((s + 20)) --budget-s $T_FUZZ & done; wait"
grep -h -E "^(FAIL|EXC)|cases passed" "$LOGS/fuzz.log" | sort | uniq -c | sort -rn | head -8
stage gpu-tier "$T_TIER" env OUT="$LOGS/tier" PYTEST_ARGS="${TIER_ARGS:--n 8 -vv}" SAN_PARALLEL=1 SAN_TIMEOUT="${SAN_TIMEOUT:-70}" \
    bash tools/gpu_check.sh ${GPU_CHECK_ARGS:-}
case " ${ONLY:-} " in *" nbhd-tier "*)   # the neighbourhood's GPU cases (ids ending -nbhd), while the modules above build
    stage nbhd-tier "$T_NBHD_TIER" "$PY" -m pytest -m gpu -k nbhd ${NBHD_TIER_ARGS:--n 8} -q -rfE -p no:cacheprovider \
        --junitxml="$LOGS/nbhd-junit.xml" tests/test_decode.py tests/test_prefill.py tests/test_cascade.py ;;
esac
wait

stage demo-tp 100 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    "$PY" tools/demo_tp.py --simulate 2 --steps 16

stage bench-decode "$T_BENCH" "$PY" tools/bench_decode.py "${BD_ARGS[@]}" --deadline "$((T_BENCH - 20))"
stage bench-invariant "$T_BENCH" "$PY" tools/bench_decode.py --quick --new --no-flashinfer --samples 20 --warm 1 \
    --deadline "$((T_BENCH - 20))" --rt-modes ${INVARIANT_MODES:-auto batch-invariant}
stage bench-overhead "$T_BENCH" "$PY" tools/bench_overhead.py --batches "${OVERHEAD_BATCHES:-1,4,8,16,64,256}" --reps "${OVERHEAD_REPS:-9}"
stage bench-cascade "$T_BENCH" "$PY" tools/bench_cascade.py --deadline "$((T_BENCH / 2))" --samples 15 \
    --libs "${CASCADE_LIBS:-rt-casc,rt-dec,rt-single,fi-casc,fi-cc}" ${CASCADE_ARGS:-}
read -r -a PF_TILES <<< "${PREFILL_TILES:-default}"   # e.g. "default x": A/B the policy's tile against an override
stage bench-prefill "$T_BENCH" "$PY" tools/bench_prefill.py --libs rt fa2 --rt-tiles "${PF_TILES[@]}" --budget-s "$((T_BENCH - 30))" \
    --rows 16x1024 4x4096 32x512 1x16384 chunk16x4096+512 8x2048 8x2048-softcap 8x2048-alibi 8x2048-window mtd64x4096-q4 mtd64x4096-q1
stage bench-prefill-peers "$T_BENCH" "$PY" tools/bench_prefill.py --libs rt fa3 sdpa sdpa-flash --samples 10 \
    --budget-s "$((T_BENCH - 30))" --rows 16x1024 4x4096 32x512 1x16384
read -r -a PF_SHAPES <<< "${PREFILL_SHAPES:-32:8:64:16 32:8:256:16 32:32:128:16 32:4:128:16 32:2:128:16 32:8:128:1 32:8:128:64}"
read -r -a PF_ORDERS <<< "${PREFILL_QUEUE_ORDERS:-lpt}"
stage bench-prefill-shapes "$T_BENCH" "$PY" tools/bench_prefill.py --libs rt fa2 --samples 5 --budget-s "$((T_BENCH - 10))" \
    --shapes "${PF_SHAPES[@]}" --rows ${PREFILL_SHAPE_ROWS:-16x1024 32x512 4x4096 16xheavy1024} \
    --queue-order "${PF_ORDERS[@]}"   # the neighbourhood, one process
stage bench-family "$((T_BENCH + 10))" bash -c "$PY tools/bench_prefill.py --libs rt rtdec --rows 'mtd*' --budget-s $((T_BENCH / 2 - 5)) && \
    $PY tools/bench_decode.py --no-flashinfer --rows 'g*' b16-all1024-kv8 s64x4096 --rt-modes auto auto+prefill \
    --deadline $((T_BENCH / 2 - 5))"

case " ${ONLY:-} " in *" nbhd-"*)   # the neighbourhood's benchmarks against FlashInfer (only when asked for)
    stage nbhd-decode "$T_NBHD_BENCH" "$PY" tools/bench_decode.py --nbhd --deadline "$((T_NBHD_BENCH - 15))"
    stage nbhd-cascade "$((T_NBHD_BENCH - 20))" "$PY" tools/bench_cascade.py --rows 'nb-*' --deadline "$((T_NBHD_BENCH - 50))" \
        --samples 15 --libs "${CASCADE_LIBS:-rt-casc,rt-dec,rt-single,fi-casc,fi-cc}"
    read -r -a NB_SHAPES <<< "${NBHD_PREFILL_SHAPES:-nbhd}"
    stage nbhd-prefill "$T_NBHD_BENCH" "$PY" tools/bench_prefill.py --libs rt fa2 --samples 5 --budget-s "$((T_NBHD_BENCH - 15))" \
        --shapes "${NB_SHAPES[@]}" --rows ${NBHD_PREFILL_ROWS:-16x1024 chunk16x4096+512 mtd64x4096-q4} ;;
esac

[ -z "${KCACHE_BACK:-}" ] || kcache_back "$OUT/kcache-new.tgz"   # KCACHE_BACK=1: bring back what was compiled here
echo "== gpu_all summary (logs: \$OUT/logs.tgz)"
printf '%s\n' "${SUMMARY[@]}"
