"""Render an AttentionSpec into CUDA source (Jinja2), with the kernel Params struct generated
from one member list shared with the host packer."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jinja2

from rtattn.plan import fields as plan_fields

from .cstruct import CStruct, Member
from .spec import DTYPES, KV_DTYPES, AttentionSpec

MERGE_THREADS = 256  # 8 warps, one (merge row, head) each per turn
_ENV = jinja2.Environment(loader=jinja2.PackageLoader("rtattn.codegen", "templates"),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def _plan_struct() -> CStruct:
    return CStruct("PlanPtrs", tuple(Member(n, "const int32_t*") for n in plan_fields.FIELD_NAMES))


def params_struct(spec: AttentionSpec) -> CStruct:
    """The kernel's single argument. Strides are in elements; `lse` may be null. An fp8 cache adds
    its scales: k_scale_f * k_scale[kv_head * k_scale_stride] (pointer null: 1; stride 0: one
    per tensor), the same for v."""
    t, kv = "DType", "KVType"
    i64 = "int64_t"
    extra = CStruct("ExtraParams", tuple(Member(p.name, p.c_type) for p in spec.params)
                    or (Member("unused_", "int"),))  # C++ has no empty structs of size 0
    members = [
        Member("q", f"const {t}*"), Member("q_stride_tok", i64), Member("q_stride_head", i64),
        Member("k_cache", f"const {kv}*"), Member("k_stride_page", i64), Member("k_stride_tok", i64),
        Member("k_stride_head", i64),
        Member("v_cache", f"const {kv}*"), Member("v_stride_page", i64), Member("v_stride_tok", i64),
        Member("v_stride_head", i64),
        Member("o", "OType*"), Member("o_stride_tok", i64), Member("o_stride_head", i64),
        Member("lse", "float*"), Member("partial_o", "float*"), Member("partial_lse", "float*"),
        Member("merge_counters", "int*"),
        Member("plan", "PlanPtrs", _plan_struct()),
        Member("num_qo_heads", "int"), Member("group_size", "int"),
        Member("merge_row_capacity", "int"), Member("page_shift", "int"),
        Member("sm_scale", "float"), Member("sm_scale_log2", "float"), Member("fused_merge", "int"),
    ]
    if spec.kv_is_fp8:
        members += [Member("k_scale", "const float*"), Member("v_scale", "const float*"),
                    Member("k_scale_stride", "int"), Member("v_scale_stride", "int"),
                    Member("k_scale_f", "float"), Member("v_scale_f", "float")]
    members.append(Member("extra", "ExtraParams", extra))
    return CStruct("Params", tuple(members))


@dataclass(frozen=True)
class Rendered:
    source: str
    decode_name: str
    merge_name: str
    smem_bytes: int
    threads: int
    params: CStruct

    @property
    def attention_name(self) -> str:
        """The attention kernel of either family (decode_name holds it for prefill too)."""
        return self.decode_name


def _common(spec: AttentionSpec) -> tuple[CStruct, dict]:
    """The Params struct and the template values every family's source shares."""
    params = params_struct(spec)
    extra = params.members[-1].nested
    head, body = params.c_source().split("{\n", 1)
    body = body.rsplit("};", 1)[0]
    return params, dict(spec=spec, ctype=DTYPES[spec.q_dtype], kv_ctype=KV_DTYPES[spec.kv_dtype],
                        o_ctype=DTYPES[spec.o_dtype], plan_struct=plan_fields.c_struct(),
                        extra_struct=extra.c_source(), params_struct_head=head + "{",
                        params_struct_body=body, params_size=_sizeof(params),
                        merge_threads=MERGE_THREADS)


@functools.lru_cache(maxsize=None)
def render_decode(spec: AttentionSpec, smem_bytes: int, min_blocks: int) -> Rendered:
    """Decode source for a spec, with the shared memory and the CTAs per SM it is compiled for
    from the decode family's resource model (rtattn.families.decode.render)."""
    params, common = _common(spec)
    threads = spec.num_warps * 32
    decode_name = f"rtattn_decode_{spec.uri}"
    merge_name = f"rtattn_merge_{spec.uri}"
    source = _ENV.get_template("decode.cu.jinja").render(
        **common, smem_bytes=smem_bytes, threads=threads, min_blocks=min_blocks,
        decode_name=decode_name, merge_name=merge_name)
    return Rendered(source, decode_name, merge_name, smem_bytes, threads, params)


@functools.lru_cache(maxsize=None)
def render_prefill(spec: AttentionSpec, tile) -> Rendered:
    """Prefill source for a spec and a rtattn.families.prefill.PrefillTile (whose resource model
    gives the shared memory and the CTAs per SM the kernel is compiled for)."""
    params, common = _common(spec)
    name = f"rtattn_prefill_{spec.variant}_{spec.dtype}_d{spec.head_dim}_{tile.tag}"
    source = _ENV.get_template("prefill.cu.jinja").render(
        **common, name=name, tile=tile, smem_bytes=tile.smem_bytes(spec.head_dim), threads=tile.threads,
        min_blocks=tile.min_blocks, prefill_name=name, merge_name=name.replace("_prefill_", "_prefill_merge_"))
    return Rendered(source, name, name.replace("_prefill_", "_prefill_merge_"), tile.smem_bytes(spec.head_dim),
                    tile.threads, params)


def _sizeof(s: CStruct) -> int:
    import ctypes
    return ctypes.sizeof(s.ctypes_type())
