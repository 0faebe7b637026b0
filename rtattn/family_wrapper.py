"""multi_token_wrapper: a wrapper on the kernel family that the cost rule (rtattn.families.choice)
predicts faster for short queries over a paged cache: multi-token decode (speculative and tree
verification, q_len 2-16) and wide head groups (g >= 16).

    w = rtattn.multi_token_wrapper(32, 8, 128, 16, max_batch=64, max_pages=16384, max_qo_len=4,
                                   avg_kv_len=4096)            # variant="causal" by default
    w.family_choice       # FamilyChoice: the family, both predictions, why
    w.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last)
    out = w.run(q, k_cache, v_cache)

The result is a BatchDecodeWrapper or a BatchPrefillWrapper: both share run()/prepare() and
graph replay; their plan() takes the same keyword arguments (positional orders differ, so pass
keywords). `family="decode" | "prefill"` forces one; `costs=` replaces the rule's constants.
"""
from __future__ import annotations

from rtattn.codegen.spec import FP8_DTYPES
from rtattn.families.choice import choose_family
from rtattn.plan import devices as plan_devices
from rtattn.plan.layout import check_int
from rtattn.prefill_wrapper import BatchPrefillWrapper
from rtattn.runtime import current_device
from rtattn.runtime.dlpack import normalize_dtype
from rtattn.wrapper import BatchDecodeWrapper


def multi_token_wrapper(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *, max_batch: int,
                        max_pages: int, max_qo_len: int, avg_kv_len: float = 4096, family: str = "auto",
                        variant="causal", dtype: str = "bfloat16", device=None, costs: dict | None = None, **kw):
    """The wrapper of the family chosen for `max_batch` requests of `max_qo_len` query tokens over
    ~`avg_kv_len` KV tokens (the sizes the choice is made for; plan() takes any batch within the
    bounds). Other keyword arguments go to the wrapper (mode, kv_layout, num_pages_pool, ...)."""
    for name, v in (("max_batch", max_batch), ("max_qo_len", max_qo_len)):
        check_int(name, v)
    dev = current_device(device)
    kv_dtype = kw.get("kv_dtype")
    kv_bytes = 1 if kv_dtype is not None and normalize_dtype(kv_dtype) in FP8_DTYPES else 2
    choice = choose_family(num_qo_heads, num_kv_heads, head_dim, max_qo_len, avg_kv_len, max_batch, family=family,
                           kv_bytes=kv_bytes, device=plan_devices.from_props(dev.props), costs=costs)
    cls = BatchDecodeWrapper if choice.family == "decode" else BatchPrefillWrapper
    w = cls(num_qo_heads, num_kv_heads, head_dim, page_size, max_batch=max_batch, max_pages=max_pages,
            max_qo_tokens=max_batch * max_qo_len, max_qo_len=max_qo_len, variant=variant, dtype=dtype, device=dev, **kw)
    w.family_choice = choice
    return w
