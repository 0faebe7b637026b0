# source tools/kcache.sh — KCACHE=FILE: a CUBIN cache built on the CPU machine
# (`RTATTN_CACHE_DIR=$PWD/.kcache rtattn-compile --arch sm_90`, packed with tar czf) and carried
# to the GPU machine is unpacked and used (RTATTN_CACHE_DIR), so its kernels are not compiled
# again there: NVRTC output is host-independent. Unset or missing: nothing happens. Sourced by
# tools/gpu_all.sh and tools/gpu_invariant.sh; never `exit`s.
if [ -n "${KCACHE:-}" ] && [ -f "$KCACHE" ]; then
    mkdir -p /tmp/rtattn_kcache && tar xzf "$KCACHE" -C /tmp/rtattn_kcache && export RTATTN_CACHE_DIR=/tmp/rtattn_kcache
    touch /tmp/rtattn_kcache/.unpacked
fi
kcache_back() {   # kcache_back OUT.tgz: pack what this machine compiled since the unpacking (tests'
    # own instances), to be merged into the CPU machine's cache and carried next time
    [ -f /tmp/rtattn_kcache/.unpacked ] || return 0
    (cd /tmp/rtattn_kcache && find cubin -name '*.bin' -newer .unpacked | tar czf "$1" -T -)
}
