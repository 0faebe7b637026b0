#!/usr/bin/env bash
# Side-by-side Nsight Compute metrics of one bench_decode row's decode kernel, for several
# rtattn configs and FlashInfer, on the GPU machine (after source tools/peer_setup.sh):
#   bash tools/ncu_compare.sh s256x4096 rt:auto rt:auto+DRTATTN_KV_EVICT_NORMAL fi-tc
# Prints one line per metric, one column per target; full reports go to $OUT/ncu_<n>.txt.
# Metrics this ncu does not know are dropped (queried first), so the list can be generous.
set -uo pipefail
cd "$(dirname "$0")/.."
row=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
want="gpu__time_duration.sum dram__bytes_read.sum dram__throughput.avg.pct_of_peak_sustained_elapsed
lts__t_sectors_op_read.sum lts__t_sectors_op_read_lookup_hit.sum lts__t_sectors_op_read_lookup_miss.sum
lts__t_sectors_srcunit_tex_op_read.sum lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum
lts__t_requests_srcunit_tex_op_read.sum lts__t_sectors_srcunit_ltcfabric.sum
lts__t_sectors_srcunit_ltcfabric_lookup_hit.sum lts__t_sectors_srcnode_gpc.sum lts__t_sectors.sum
lts__t_sectors_lookup_hit.sum lts__d_sectors_fill_sysmem.sum lts__t_sectors_op_write.sum
lts__throughput.avg.pct_of_peak_sustained_elapsed l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum smsp__inst_executed.sum sm__cycles_active.avg
smsp__warps_issue_stalled_long_scoreboard_per_warp_active.pct"
known=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
metrics=""
for m in $want; do
    base=${m%.*}
    if grep -qx -- "$base" <<<"$known" || grep -qx -- "${base%_per_warp_active}" <<<"$known" || [ -z "$known" ]; then
        metrics="$metrics,$m"
    else
        echo "ncu_compare: dropping unknown metric $m" >&2
    fi
done
metrics=${metrics#,}
i=0
names=()
for target in "$@"; do
    i=$((i + 1))
    case $target in
        rt:*) args=(--kernel-name regex:rtattn_decode --launch-skip 1 --launch-count 1
                    python tools/profile_decode.py "$row" --config "${target#rt:}");;
        fi-*) args=(--kernel-name regex:BatchPrefill\|BatchDecode --launch-skip 1 --launch-count 1
                    python tools/profile_decode.py "$row" --lib "$target");;
        *) echo "unknown target $target"; exit 2;;
    esac
    timeout 240 ncu --clock-control none --csv --page raw --metrics "$metrics" "${args[@]}" \
        > "$OUT/ncu_$i.csv" 2> "$OUT/ncu_$i.err" || echo "ncu_compare: $target failed (see ncu_$i.err)"
    names+=("$target")
done
python3 - "$OUT" "${names[@]}" <<'PY'
import csv, io, sys
out, names = sys.argv[1], sys.argv[2:]
cols = []
for i, _ in enumerate(names, 1):
    text = open(f"{out}/ncu_{i}.csv").read()
    lines = [l for l in text.splitlines() if l.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    cols.append(dict(zip(rows[0], rows[2])) if len(rows) > 2 else {})
keys = [k for k in (cols[0] if cols else {}) if "__" in k]
print(f"{'metric':<62}" + "".join(f"{n[:22]:>24}" for n in names))
for k in keys:
    print(f"{k[:62]:<62}" + "".join(f"{c.get(k, '-'):>24}" for c in cols))
PY
