"""AttentionSpec: everything that makes one compiled kernel different from another.

A variant is a C++ struct deriving from rtattn::VariantBase (cuda_src/variant_base.cuh) plus
the extra parameters its hooks read as `p.extra.<name>`. Built-ins live in cuda_src/variants.cuh;
a user variant is a snippet defining its own struct (see `custom_variant`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from rtattn.plan.layout import HEAD_DIMS

DTYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
    dtype: str = "bfloat16"      # q, k, v and o element type
    head_dim: int = 128
    paged: bool = True           # False: dense/ragged KV, handled as page size 1 by the plan
    m_tiles: int = 1             # 16-row query tiles per CTA (rows = query tokens x fused heads)
    num_warps: int = 4
    stages: int = 3
    # What the variant does, as data the planner and the wrapper read (never the name):
    causal: bool = False         # query token i sees KV positions <= q_pos(i): plans clip each tile there
    window: bool = False         # sliding window p.extra.window_left, given to plan(): plans read only it
    sinks: bool = False          # a per-query-head logit p.extra.sinks[h] joins each row's softmax once

    def __post_init__(self):
        if not _IDENT.match(self.variant):
            raise ValueError(f"variant name {self.variant!r} must be a C identifier")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not supported; use one of {sorted(DTYPES)}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} not supported; use one of {HEAD_DIMS}")
        if self.m_tiles not in (1, 2) or (self.m_tiles == 2 and self.head_dim > 128):
            raise ValueError(f"m_tiles={self.m_tiles} with head_dim={self.head_dim}: use 1, or 2 for "
                             f"head_dim <= 128 (32 fused rows do not fit the registers at 256)")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in {names}")
        for flag, param in (("window", "window_left"), ("sinks", "sinks")):
            if getattr(self, flag) and param not in names:
                raise ValueError(f"{flag}=True needs the parameter {param!r} (the kernel reads p.extra.{param})")

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles

    @property
    def uri(self) -> str:
        """Readable name of the specialization; kernel symbols derive from it."""
        return (f"{self.variant}_{self.dtype}_d{self.head_dim}_m{self.m_tiles}"
                f"_w{self.num_warps}_s{self.stages}")

    def with_(self, **changes) -> "AttentionSpec":
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
        params=tuple(params), causal=causal, window=window, sinks=sinks, **kw)


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


def default_stages(head_dim: int, arch: str) -> int:
    """KV pipeline depth: 3 stages, except head_dim 256 before Hopper (A100's 163 KiB of shared
    memory per block holds only 2)."""
    return 2 if head_dim > 128 and int(re.match(r"sm_(\d+)", arch).group(1)) < 90 else 3


def shipped_specs(arch: str = "sm_90") -> list[AttentionSpec]:
    """Every kernel instance the package ships for `arch` (what rtattn-compile warms)."""
    out = []
    for make in BUILTINS.values():
        for dtype in DTYPES:
            for head_dim in HEAD_DIMS:
                for m_tiles in ((1, 2) if head_dim <= 128 else (1,)):
                    out.append(make(dtype=dtype, head_dim=head_dim, m_tiles=m_tiles,
                                    stages=default_stages(head_dim, arch)))
    return out
