"""AttentionSpec: everything that makes one compiled kernel different from another.

A variant is a C++ struct deriving from rtattn::VariantBase (cuda_src/variant_base.cuh) plus
the extra parameters its hooks read as `p.extra.<name>`. Built-ins live in cuda_src/variants.cuh;
a user variant is a snippet defining its own struct (see `custom_variant`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from rtattn.plan.layout import HEAD_DIMS

DTYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}   # q and output element types
FP8_DTYPES = {"float8_e4m3fn": "rtattn::Fp8E4M3", "float8_e5m2": "rtattn::Fp8E5M2"}
KV_DTYPES = {**DTYPES, **FP8_DTYPES}                              # KV cache element types
_SHORT = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}         # as spelled in kernel names
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def max_m_tiles(head_dim: int) -> int:
    """16-row query tiles the decode kernel's registers hold per CTA: 2 up to head_dim 128, 1 beyond."""
    return 2 if head_dim <= 128 else 1


@dataclass(frozen=True)
class Param:
    """An extra kernel parameter: `name` as the hooks read it (p.extra.name), its C type."""
    name: str
    c_type: str  # "float", "int", "const float*", "const uint8_t*", "const int32_t*", ...

    def __post_init__(self):
        if not _IDENT.match(self.name):
            raise ValueError(f"parameter name {self.name!r} is not a C identifier")

    @property
    def is_pointer(self) -> bool:
        return self.c_type.rstrip().endswith("*")


@dataclass(frozen=True)
class AttentionSpec:
    variant: str                 # short name, spelled into kernel names
    variant_type: str            # C++ type of the variant struct
    params: tuple[Param, ...] = ()
    variant_source: str = ""     # C++ defining variant_type (empty for built-ins)
    # Shorthand for every element type not given below (default bfloat16); reads back as q_dtype.
    dtype: str | None = None
    head_dim: int = 128
    paged: bool = True           # False: dense/ragged KV, handled as page size 1 by the plan
    m_tiles: int = 1             # 16-row query tiles per CTA (rows = query tokens x fused heads)
    num_warps: int = 4
    stages: int = 3
    # What the variant does, as data the planner and the wrapper read (never the name):
    causal: bool = False         # query token i sees KV positions <= q_pos(i): plans clip each tile there
    window: bool = False         # sliding window p.extra.window_left, given to plan(): plans read only it
    sinks: bool = False          # a per-query-head logit p.extra.sinks[h] joins each row's softmax once
    linear_bias: bool = False    # logits start at a per-row linear bias (ALiBi; has_linear_bias): more registers
    q_dtype: str | None = None   # q: bfloat16 | float16
    kv_dtype: str | None = None  # K and V caches: q's type, float8_e4m3fn or float8_e5m2
    o_dtype: str | None = None   # output: bfloat16 | float16 (default q's)
    # Batch-invariant plans (decode): items fold fixed chunks' states (cuda_src/decode.cuh INVARIANT)
    invariant: bool = False
    # A cascade level launched after another level (decode only): no wait at entry, one before
    # exiting (cuda_src/decode.cuh RTATTN_INDEPENDENT_LEVEL)
    independent: bool = False
    # ... which also joins the earlier levels' states into its writethrough rows, so no fold
    # kernel follows (cuda_src/decode.cuh RTATTN_LEVEL_JOIN; needs `independent`)
    level_join: bool = False
    # ... whose CTAs but (0, 0) leave after their items without the exit wait, freeing their SM
    # slots while the previous grid runs (cuda_src/decode.cuh RTATTN_LEAVE_EARLY; needs
    # `independent`, not `level_join`: the joined states need the wait in every CTA)
    leave_early: bool = False

    def __post_init__(self):
        if not _IDENT.match(self.variant):
            raise ValueError(f"variant name {self.variant!r} must be a C identifier")
        self._resolve_dtypes()
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} not supported; use one of {HEAD_DIMS}")
        if self.m_tiles not in (1, 2) or self.m_tiles > max_m_tiles(self.head_dim):
            raise ValueError(f"m_tiles={self.m_tiles} with head_dim={self.head_dim}: use 1, or 2 for "
                             f"head_dim <= 128 (32 fused rows do not fit the registers at 256)")
        if self.level_join and not self.independent:
            raise ValueError("level_join=True needs independent=True (the joined states are the previous grid's)")
        if self.leave_early and (not self.independent or self.level_join):
            raise ValueError("leave_early=True needs independent=True and level_join=False (a joining CTA waits "
                             "for the previous grid's states)")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in {names}")
        for flag, param in (("window", "window_left"), ("sinks", "sinks")):
            if getattr(self, flag) and param not in names:
                raise ValueError(f"{flag}=True needs the parameter {param!r} (the kernel reads p.extra.{param})")

    def _resolve_dtypes(self) -> None:
        """Every element type spelled out (aliases such as 'e4m3' or 'bf16' accepted)."""
        from rtattn.runtime.dlpack import normalize_dtype

        def name(field: str, value, allowed) -> str:
            try:
                n = normalize_dtype(value)
            except TypeError:
                n = value
            if n not in allowed:
                raise ValueError(f"{field} {value!r} not supported; use one of {sorted(allowed)}")
            return n

        given = name("dtype", self.dtype, DTYPES) if self.dtype is not None else None
        q = name("q_dtype", self.q_dtype, DTYPES) if self.q_dtype is not None else given or "bfloat16"
        if given is not None and given != q:
            raise ValueError(f"dtype={self.dtype!r} and q_dtype={self.q_dtype!r} disagree (dtype is q's type)")
        kv = name("kv_dtype", self.kv_dtype, KV_DTYPES) if self.kv_dtype is not None else q
        o = name("o_dtype", self.o_dtype, DTYPES) if self.o_dtype is not None else q
        for f, v in (("dtype", q), ("q_dtype", q), ("kv_dtype", kv), ("o_dtype", o)):
            object.__setattr__(self, f, v)

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype in FP8_DTYPES

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles

    @property
    def uri(self) -> str:
        """Readable name of the specialization; kernel symbols derive from it. The KV and output
        types are spelled only where they differ from q's (plain_bfloat16_kve4m3_d128_...)."""
        kv = "" if self.kv_dtype == self.q_dtype else f"_kv{_SHORT.get(self.kv_dtype, self.kv_dtype)}"
        o = "" if self.o_dtype == self.q_dtype else f"_o{self.o_dtype}"
        return (f"{self.variant}_{self.q_dtype}{kv}{o}_d{self.head_dim}_m{self.m_tiles}"
                f"_w{self.num_warps}_s{self.stages}{'_inv' if self.invariant else ''}{'_ind' if self.independent else ''}"
                f"{'_join' if self.level_join else ''}{'_le' if self.leave_early else ''}")

    def with_(self, **changes) -> "AttentionSpec":
        """replace(); `dtype=` sets q's type, and the KV and output types that followed it."""
        if "dtype" in changes and changes["dtype"] is not None:
            new = changes["dtype"]
            changes.setdefault("q_dtype", new)
            for f in ("kv_dtype", "o_dtype"):
                if getattr(self, f) == self.q_dtype:
                    changes.setdefault(f, new)
        return replace(self, **changes)


def _b(x: bool) -> str:
    return "true" if x else "false"


def standard(causal=False, window=False, soft_cap=False, alibi=False, sinks=False, **kw) -> AttentionSpec:
    """Softmax attention with any mix of causal mask, sliding window, soft-cap, ALiBi and
    attention sinks (float32 [H_qo] logits, natural-log units like sm_scale * q.k)."""
    params = []
    if window:
        params.append(Param("window_left", "int"))
    if soft_cap:
        params.append(Param("soft_cap", "float"))
    if alibi:
        params.append(Param("alibi_slopes", "const float*"))
    if sinks:
        params.append(Param("sinks", "const float*"))
    flags = (("causal", causal), ("window", window), ("softcap", soft_cap), ("alibi", alibi), ("sinks", sinks))
    return AttentionSpec(
        variant="_".join(t for t, on in flags if on) or "plain",
        variant_type=f"rtattn::StandardAttention<{', '.join(_b(on) for _, on in flags)}>",
        params=tuple(params), causal=causal, window=window, sinks=sinks, linear_bias=alibi, **kw)


def sigmoid(**kw) -> AttentionSpec:
    return AttentionSpec("sigmoid", "rtattn::SigmoidAttention", (Param("sigmoid_bias", "float"),), **kw)


def rope(causal=False, **kw) -> AttentionSpec:
    return AttentionSpec("rope_causal" if causal else "rope", f"rtattn::RopeAttention<{_b(causal)}>",
                         (Param("rope_theta", "float"), Param("rope_offset", "int")), causal=causal, **kw)


def custom_mask(**kw) -> AttentionSpec:
    return AttentionSpec("custom_mask", "rtattn::CustomMaskAttention",
                         (Param("mask", "const uint8_t*"), Param("mask_offsets", "const int64_t*")), **kw)


def custom_variant(name: str, source: str, struct_name: str, params=(), **kw) -> AttentionSpec:
    """A variant that is not built in: `source` defines `struct struct_name : rtattn::VariantBase`.
    Declare what its mask does (causal=True, window=True) so plans skip the KV it never sees;
    sinks=True must match the struct's has_sink (checked at compile time)."""
    return AttentionSpec(name, struct_name, tuple(params), variant_source=source, **kw)


BUILTINS = {
    "plain": lambda **kw: standard(**kw),
    "causal": lambda **kw: standard(causal=True, **kw),
    "sliding_window": lambda **kw: standard(window=True, **kw),
    "soft_cap": lambda **kw: standard(soft_cap=True, **kw),
    "alibi": lambda **kw: standard(alibi=True, **kw),
    "sinks": lambda **kw: standard(sinks=True, **kw),
    "sliding_window_sinks": lambda **kw: standard(window=True, sinks=True, **kw),
    "sigmoid": sigmoid,
    "rope": rope,
    "custom_mask": custom_mask,
}
