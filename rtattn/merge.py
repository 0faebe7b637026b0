"""merge_state / merge_states: the attention-state merge operator on DLPack tensors.

States are (O, LSE) with LSE in natural log (rtattn's convention everywhere); an LSE of -inf
marks an empty state (O ignored). Merging is exact up to rounding and done in index order,
so it is deterministic. Inputs may be bfloat16, float16 or float32 O with float32 LSE.
"""
from __future__ import annotations

import functools

from rtattn.codegen.cstruct import CStruct, Member
from rtattn.runtime import DeviceBuffer, Module, as_stream, compile_to_cubin, current_device
from rtattn.tensors import cuda_tensor, expect_inner_contiguous, expect_shape, same_device

_KERNELS = {"bfloat16": "rtattn_merge_states_bf16", "float16": "rtattn_merge_states_f16",
            "float32": "rtattn_merge_states_f32"}
_CTYPE = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}
_I64 = "int64_t"
PARAMS = CStruct("MergeStatesParams", (
    Member("v", "const void*"), Member("s", "const float*"), Member("v_out", "void*"), Member("s_out", "float*"),
    Member("v_stride_row", _I64), Member("v_stride_state", _I64), Member("v_stride_head", _I64),
    Member("s_stride_row", _I64), Member("s_stride_state", _I64), Member("s_stride_head", _I64),
    Member("o_stride_row", _I64), Member("o_stride_head", _I64),
    Member("rows", "int"), Member("num_states", "int"), Member("heads", "int"), Member("head_dim", "int"),
))
THREADS = 256


def source() -> str:
    kernels = "".join(
        f'extern "C" __global__ void {name}(const __grid_constant__ MergeStatesParams p) '
        f"{{ rtattn::merge_states_kernel<{_CTYPE[dt]}>(p); }}\n" for dt, name in _KERNELS.items())
    return f'#include "types.cuh"\n#include "merge_states.cuh"\n{PARAMS.c_source()}{kernels}'


@functools.lru_cache(maxsize=None)
def _module(ordinal: int) -> Module:
    dev = current_device(ordinal)
    return Module.load(compile_to_cubin(source(), name="merge_states", arch=dev.arch), dev)


def merge_states(v, s, *, out=None, s_out=None, stream=None):
    """Merge n states per row: v [rows, n, heads, D], s [rows, n, heads] -> (v [rows, heads, D], s [rows, heads])."""
    stream = as_stream(stream)
    vt = cuda_tensor("v", v, stream, ndim=4)
    rows, n, heads, d = vt.shape
    st = cuda_tensor("s", s, stream, dtype="float32", ndim=3)
    expect_shape("s", st, (rows, n, heads))
    expect_inner_contiguous("v", vt)
    same_device({"s": st}, vt.device_id)
    return _launch(vt, vt.strides[:3], st, st.strides, n, out, s_out, stream)


def merge_state(v_a, s_a, v_b, s_b, *, out=None, s_out=None, stream=None):
    """Merge two states: v_* [rows, heads, D], s_* [rows, heads] -> (v, s)."""
    stream = as_stream(stream)
    va, vb = cuda_tensor("v_a", v_a, stream, ndim=3), cuda_tensor("v_b", v_b, stream, ndim=3)
    sa = cuda_tensor("s_a", s_a, stream, dtype="float32", ndim=2)
    sb = cuda_tensor("s_b", s_b, stream, dtype="float32", ndim=2)
    if va.dtype != vb.dtype:
        raise TypeError(f"v_a is {va.dtype} but v_b is {vb.dtype}")
    expect_shape("v_b", vb, va.shape)
    expect_shape("s_a", sa, va.shape[:2])
    expect_shape("s_b", sb, va.shape[:2])
    for name, (x, y) in {"v": (va, vb), "s": (sa, sb)}.items():
        if x.strides != y.strides:
            raise ValueError(f"{name}_a and {name}_b must have the same strides, got {x.strides} and {y.strides}")
    expect_inner_contiguous("v_a", va)
    same_device({"v_b": vb, "s_a": sa, "s_b": sb}, va.device_id)
    # State b is state a shifted by a (possibly negative) element offset: a 2-state view.
    v_state = (vb.ptr - va.ptr) // va.itemsize
    s_state = (sb.ptr - sa.ptr) // 4
    return _launch(va, (va.strides[0], v_state, va.strides[1]), sa, (sa.strides[0], s_state, sa.strides[1]), 2,
                   out, s_out, stream)


def _launch(vt, v_strides, st, s_strides, n, out, s_out, stream):
    if vt.dtype not in _KERNELS:
        raise TypeError(f"v has dtype {vt.dtype}; state merging takes {sorted(_KERNELS)}")
    rows, heads, d = vt.shape[0], vt.shape[-2], vt.shape[-1]
    dev = current_device(vt.device_id)
    if out is None:
        out = DeviceBuffer(max(rows * heads * d, 1) * vt.itemsize, dev).as_tensor(vt.dtype, (rows, heads, d), stream=stream)
    if s_out is None:
        s_out = DeviceBuffer(max(rows * heads, 1) * 4, dev).as_tensor("float32", (rows, heads), stream=stream)
    ot = cuda_tensor("out", out, stream, dtype=vt.dtype, ndim=3)
    expect_shape("out", ot, (rows, heads, d))
    expect_inner_contiguous("out", ot)
    so = cuda_tensor("s_out", s_out, stream, dtype="float32", ndim=2)
    same_device({"out": ot, "s_out": so}, dev.ordinal)
    expect_shape("s_out", so, (rows, heads))
    if so.strides != (heads, 1):
        raise ValueError(f"s_out must be contiguous, got strides {so.strides}")
    if rows * heads:
        params = PARAMS.pack(v=vt.ptr, s=st.ptr, v_out=ot.ptr, s_out=so.ptr,
                             v_stride_row=v_strides[0], v_stride_state=v_strides[1], v_stride_head=v_strides[2],
                             s_stride_row=s_strides[0], s_stride_state=s_strides[1], s_stride_head=s_strides[2],
                             o_stride_row=ot.strides[0], o_stride_head=ot.strides[1],
                             rows=rows, num_states=n, heads=heads, head_dim=d)
        blocks = min(-(-rows * heads // (THREADS // 32)), dev.props.sm_count * 8)
        _module(dev.ordinal).function(_KERNELS[vt.dtype]).launch((blocks,), (THREADS,), params, 0, stream)
    return out, s_out
