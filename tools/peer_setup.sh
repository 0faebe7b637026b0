# source tools/peer_setup.sh — make FlashInfer 0.7.4 (the benchmark peer) importable on the
# GPU machine (no network). The wheels come from `../shared/tools/peer-wheels .peer` run on a
# networked machine; the GPU call carries them with `carry: [".peer"]`. Idempotent; sourced,
# so it never `exit`s or changes shell options. Override the folder with PEER_DIR.
_rt_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_peer_dir=${PEER_DIR:-$_rt_root/.peer}
if [ -d /tmp/site/flashinfer ]; then
    :
elif ls "$_peer_dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$_peer_dir"/*.whl \
        || echo "peer_setup: installing the FlashInfer wheels from $_peer_dir FAILED" >&2
else
    echo "peer_setup: no wheels in $_peer_dir (carry .peer); FlashInfer rows will report ERR" >&2
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws MAX_JOBS=16
mkdir -p /tmp/fi_ws
# rtattn itself, unless the calling script installed it already.
if ! (cd /tmp && python3 -c "import rtattn.wrapper") >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-build-isolation -e "$_rt_root" \
        || echo "peer_setup: installing rtattn (pip install -e) FAILED" >&2
fi
unset _rt_root _peer_dir
