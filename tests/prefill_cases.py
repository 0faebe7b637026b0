"""GPU test workloads for the prefill path: ragged query batches over paged (or ragged) KV built
with decode_cases.make_case, run through BatchPrefillWrapper with poisoned outputs, and the
float64 reference's error. Imported by tests/test_prefill.py and tools/smoke_prefill.py."""
from __future__ import annotations

import numpy as np

from decode_cases import lse_error, make_case, rel_error
from rtattn.plan import reference as ref

TOL = {"bfloat16": 2e-2, "float16": 5e-3}


def ragged_kv(case):
    """K and V as [kv_tokens, H_kv, D] in request order (the paged case's data, gathered), and the
    token kv_indptr."""
    import torch
    assert case.page_size == 1 and case.kv_layout == "NHD"
    idx = torch.from_numpy(case.kv_indices[: int(case.kv_indptr[-1])].astype(np.int64)).cuda()
    k = case.k_cache[idx, 0].contiguous()
    v = case.v_cache[idx, 0].contiguous()
    return k, v, case.kv_indptr.copy()


def run_prefill(case, variant="causal", dtype="bfloat16", params=None, ragged=False, lse=True, **kw):
    """Poisoned out/lse, plan + run; returns (O, LSE) as numpy and the wrapper."""
    import torch
    from rtattn.prefill_wrapper import BatchPrefillWrapper
    T, H, D = case.q.shape
    Hk = case.k_cache.shape[2] if case.kv_layout == "NHD" else case.k_cache.shape[1]
    B = len(case.kv_lens)
    common = dict(max_batch=B + 2, max_qo_tokens=T + 8, variant=variant, dtype=dtype, **kw)
    window = {"window_left": params["window_left"]} if params and "window_left" in params else {}
    if ragged:
        k, v, kv_indptr = ragged_kv(case)
        w = BatchPrefillWrapper(H, Hk, D, kv_layout="ragged", max_kv_tokens=int(kv_indptr[-1]) + 7, **common)
        w.plan(case.qo_indptr, kv_indptr, **window)
    else:
        k, v = case.k_cache, case.v_cache
        w = BatchPrefillWrapper(H, Hk, D, case.page_size, kv_layout=case.kv_layout,
                                max_pages=int(case.kv_indptr[-1]) + 5, **common)
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len, **window)
    out = torch.full_like(case.q, float("nan"))
    lse_t = torch.full((T, H), float("nan"), device="cuda") if lse else None
    w.run(case.q, k, v, out=out, lse=lse_t, params=params)
    torch.cuda.synchronize()
    return out.float().cpu().numpy(), (lse_t.cpu().numpy() if lse else None), w


def errors(case, o, lse, var=ref.Variant()):
    want_o, want_lse = case.reference(var)
    return rel_error(o, want_o), (lse_error(lse, want_lse) if lse is not None else 0.0)


_PARTS = {"causal": "causal", "sliding_window": "window", "soft_cap": "soft_cap", "alibi": "alibi"}


def combo_spec(name: str, dtype: str = "bfloat16", head_dim: int = 128):
    """'causal+alibi+soft_cap': the StandardAttention spec with those parts together (names of
    built-ins joined by '+'; variant_args gives their parameters and reference)."""
    from rtattn.codegen import spec as S
    parts = name.split("+")
    if not set(parts) <= set(_PARTS):
        raise ValueError(f"{name!r}: join names of {sorted(_PARTS)} with '+'")
    return S.standard(**{_PARTS[part]: True for part in parts}, dtype=dtype, head_dim=head_dim)


def variant_args(variant, num_qo_heads, qo_lens, kv_lens, rng):
    """(params, reference Variant) for a built-in variant name, or for parts joined by '+'."""
    import torch
    if "+" in variant:
        params, fields, plain = {}, {}, vars(ref.Variant())
        for part in variant.split("+"):
            p, v = variant_args(part, num_qo_heads, qo_lens, kv_lens, rng)
            params.update(p or {})
            fields.update({k: x for k, x in vars(v).items() if not (x is plain[k] or (np.isscalar(x) and x == plain[k]))})
        return params or None, ref.Variant(**fields)
    if variant == "causal":
        return None, ref.Variant(causal=True)
    if variant == "plain":
        return None, ref.Variant()
    if variant == "sliding_window":
        return {"window_left": 200}, ref.Variant(window_left=200)
    if variant == "soft_cap":
        return {"soft_cap": 3.0}, ref.Variant(logits_soft_cap=3.0)
    if variant == "alibi":
        slopes = torch.tensor(ref.alibi_slopes(num_qo_heads), dtype=torch.float32, device="cuda")
        return {"alibi_slopes": slopes}, ref.Variant(alibi=True)
    if variant == "sinks":
        sinks = rng.normal(0.0, 2.0, num_qo_heads).astype(np.float32)
        return {"sinks": torch.from_numpy(sinks).cuda()}, ref.Variant(sinks=sinks.astype(np.float64))
    if variant == "sigmoid":
        return {"sigmoid_bias": -1.5}, ref.Variant(sigmoid=True, sigmoid_bias=-1.5)
    if variant == "rope":
        return {"rope_theta": 1e4, "rope_offset": 3}, ref.Variant(rope=True, rope_offset=3)
    if variant == "custom_mask":
        masks = [rng.random((q, k)) < 0.7 for q, k in zip(qo_lens, kv_lens)]
        bits, offs = ref.pack_custom_mask(masks)
        return ({"mask": torch.from_numpy(bits).cuda(), "mask_offsets": torch.from_numpy(offs).cuda()},
                ref.Variant(custom_mask=bits, mask_offsets=offs))
    raise ValueError(variant)


__all__ = ["TOL", "combo_spec", "errors", "make_case", "ragged_kv", "run_prefill", "variant_args"]
