"""The cascade fold kernel: every level's attention states of a query row -> output and LSE.

The states are float32 rows that the levels' work items wrote into the cascade workspace; the
plan set lists each query row's rows in level order (rtattn.plan.cascade). The kernel folds
them with the state operator of cuda_src/state_fold.cuh (the merge kernel's), so the result
is deterministic and exact up to float32 rounding. Its grid is fixed (a persistent loop over
the plan's query rows), so a captured graph replays for any plan.
"""
from __future__ import annotations

import functools

from rtattn.codegen.cstruct import CStruct, Member
from rtattn.codegen.spec import DTYPES
from rtattn.kernels import dev_defines
from rtattn.runtime import Device, Module, compile_to_cubin

THREADS = 256
CTAS_PER_SM = 2


def params_struct(dtype: str) -> CStruct:
    return CStruct("FoldParams", (
        Member("state_o", "const float*"), Member("state_lse", "const float*"),
        Member("o", f"{DTYPES[dtype]}*"), Member("o_stride_tok", "int64_t"), Member("o_stride_head", "int64_t"),
        Member("lse", "float*"), Member("fold_indptr", "const int32_t*"), Member("fold_rows", "const int32_t*"),
        Member("fold_info", "const int32_t*"), Member("num_qo_heads", "int"),
    ))


def kernel_name(dtype: str, head_dim: int, softmax: bool) -> str:
    return f"rtattn_cascade_fold_{dtype}_d{head_dim}_{'softmax' if softmax else 'sum'}"


def source(dtype: str, head_dim: int, softmax: bool) -> str:
    import ctypes
    t, ps = DTYPES[dtype], params_struct(dtype)
    return ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include \"types.cuh\"\n"
            "#include \"cascade_fold.cuh\"\n" + ps.c_source() +
            f"static_assert(sizeof(FoldParams) == {ctypes.sizeof(ps.ctypes_type())}, "
            f"\"host and device disagree on sizeof(FoldParams)\");\n" +
            f'extern "C" __global__ void __launch_bounds__({THREADS}, {CTAS_PER_SM})\n'
            f"{kernel_name(dtype, head_dim, softmax)}(const __grid_constant__ FoldParams p) {{\n"
            f"  rtattn::cascade_fold<{t}, {'true' if softmax else 'false'}, {head_dim}, {THREADS // 32}>(p);\n}}\n")


def compile_fold(dtype: str, head_dim: int, softmax: bool, arch: str) -> bytes:
    """CUBIN of the fold kernel (through the on-disk cache); needs no GPU."""
    return bytes(compile_to_cubin(source(dtype, head_dim, softmax), name=kernel_name(dtype, head_dim, softmax),
                                  arch=arch, options=dev_defines()))


@functools.lru_cache(maxsize=None)
def fold_function(dtype: str, head_dim: int, softmax: bool, device_ordinal: int = 0):
    """The loaded fold kernel (one module per configuration and device per process)."""
    dev = Device(device_ordinal)
    mod = Module.load(compile_fold(dtype, head_dim, softmax, dev.arch), dev)
    return mod.function(kernel_name(dtype, head_dim, softmax))
