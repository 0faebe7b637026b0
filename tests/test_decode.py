"""Decode + merge kernels against the float64 reference (GPU tier), and the codegen that makes
them (CPU tier: every built-in renders and compiles for sm_80 and sm_90)."""
from __future__ import annotations

import numpy as np
import pytest

from decode_cases import INVARIANT_CASES
from rtattn.codegen import spec as S
from rtattn.kernels import compile_spec
from rtattn.plan import reference as ref

BUILTIN_SPECS = [S.standard(), S.standard(causal=True), S.standard(window=True), S.standard(soft_cap=True),
                 S.standard(alibi=True), S.sigmoid(), S.rope(), S.custom_mask(), S.standard(sinks=True),
                 S.standard(window=True, sinks=True, soft_cap=True)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("spec", BUILTIN_SPECS[:4] + BUILTIN_SPECS[5:7] + BUILTIN_SPECS[8:], ids=lambda s: s.variant)
def test_builtin_variants_compile(spec, arch, isolated_cache):
    rendered, cubin = compile_spec(spec, arch, quiet=True)
    assert cubin[:4] == b"\x7fELF"
    assert rendered.decode_name in rendered.source


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_head_dims_and_dtypes_compile(head_dim, dtype, isolated_cache):
    _, cubin = compile_spec(S.standard(head_dim=head_dim, dtype=dtype), "sm_90", quiet=True)
    assert cubin[:4] == b"\x7fELF"


def test_invariant_soft_cap_d256_keeps_its_constants_in_registers(isolated_cache):
    """The batch-invariant soft-cap d256 build (255 registers, one CTA per SM) has no stack: its
    warps' combine stores at immediate offsets of one lane base (indexed by column, LICM kept 64
    addresses live across the item and 32 B of thread constants went to the stack, 3 local loads per
    KV block: docs/perf-log.md "Batch-invariant v6")."""
    import re

    from rtattn.families import decode as decode_family
    from rtattn.families import resources
    from rtattn.kernels import COMPILE_OPTIONS
    from rtattn.runtime import compile_to_cubin
    spec = next(s for s in decode_family.shipped("sm_90") if s.uri == "softcap_bfloat16_d256_m1_w4_s3_inv")
    rendered = decode_family.render(spec, resources.device_for_arch("sm_90"))
    log = compile_to_cubin(rendered.source, name=spec.uri, arch="sm_90", quiet=True,
                           options=COMPILE_OPTIONS + ("--ptxas-options=-v",)).log
    decode = log.split("Compiling entry function '" + rendered.decode_name)[1].split("Compiling entry function")[0]
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", decode), decode[:400]


def test_kernel_names_spell_the_specialization():
    s = S.standard(causal=True, soft_cap=True, dtype="float16", head_dim=64)
    assert s.uri == "causal_softcap_float16_d64_m1_w4_s3"


def test_variant_properties_are_data():
    assert S.BUILTINS["causal"]().causal and not S.BUILTINS["plain"]().causal
    w = S.BUILTINS["sliding_window_sinks"]()
    assert (w.window, w.sinks, w.causal) == (True, True, False) and w.variant == "window_sinks"
    assert S.rope(causal=True).causal and not S.rope().causal
    assert not any(getattr(S.BUILTINS["custom_mask"](), f) for f in ("causal", "window", "sinks"))
    with pytest.raises(ValueError, match="window=True needs the parameter 'window_left'"):
        S.custom_variant("w", "struct W : rtattn::VariantBase {};", "W", window=True)


def test_sinks_flag_must_match_the_struct(isolated_cache):
    from rtattn.runtime import CompileError
    bad = S.custom_variant("lying_sinks", "struct L : rtattn::VariantBase {};", "L",
                           (S.Param("sinks", "const float*"),), sinks=True)
    with pytest.raises(CompileError, match="has_sink"):
        compile_spec(bad, "sm_90", quiet=True)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="head_dim"):
        S.standard(head_dim=96)
    with pytest.raises(ValueError, match="dtype"):
        S.standard(dtype="float32")
    with pytest.raises(ValueError, match="C identifier"):
        S.Param("not a name", "float")


@pytest.mark.parametrize("name", list(INVARIANT_CASES))
def test_invariant_cases_split_request_0_differently(name):
    """The GPU invariance cases mean something: with the H200 grid their kernels get (132 SMs x
    CTAs per SM by shared memory, registers 255 / 168 at d64), request 0 is cut into different
    items alone and among all its companions."""
    from rtattn.families.decode import invariant_build, spec_for
    from rtattn.families.decode import smem_bytes as decode_smem_bytes
    from rtattn.plan.devices import get_device
    from rtattn.plan.inspector import Planner
    from rtattn.plan.layout import paged_kv
    from rtattn.plan.tiles import occupancy
    c = INVARIANT_CASES[name]
    (hq, hk), d, ps = c["heads"], c["d"], c["ps"]
    spec = invariant_build(spec_for(c.get("variant", "plain"), "bfloat16", d, hq // hk, "sm_90"), "sm_90")
    per_sm = occupancy(get_device("h200"), 128, 168 if d == 64 else 255, decode_smem_bytes(spec))
    p = Planner(8, 8, 8000, hq, hk, d, ps, mode="batch-invariant", num_ctas=132 * per_sm // hk, max_qo_len=1)
    seen = set()
    for subset in ([0], list(range(len(c["kv"])))):
        kv = np.array(c["kv"])[subset]
        info = p.plan(np.arange(len(kv) + 1, dtype=np.int32), *paged_kv(kv, ps), window_left=c.get("window"))
        v, n = info.views, info.num_items
        seen.add(tuple(sorted(v["item_kv_start"][:n][v["item_request"][:n] == 0].tolist())))
    assert len(seen) == 2


# ----------------------------------------------------------------------------- GPU tier
TOL = {"bfloat16": 2e-2, "float16": 5e-3}


def _run(case, variant="plain", dtype="bfloat16", mode="balanced", params=None, lse=True, window_left=None,
         run_kw=None, **kw):
    import torch
    from rtattn.wrapper import BatchDecodeWrapper
    T, H, D = case.q.shape
    Hk = case.k_cache.shape[2] if case.kv_layout == "NHD" else case.k_cache.shape[1]
    w = BatchDecodeWrapper(H, Hk, D, case.page_size, max_batch=len(case.kv_lens) + 3,
                           max_pages=int(case.kv_indptr[-1]) + 5, max_qo_tokens=T + 8, variant=variant,
                           dtype=dtype, kv_layout=case.kv_layout, mode=mode, **kw)
    w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, qo_indptr=case.qo_indptr, window_left=window_left)
    out = torch.full_like(case.q, float("nan"))                     # poisoned
    lse_t = torch.full((T, H), float("nan"), device="cuda") if lse else None
    w.run(case.q, case.k_cache, case.v_cache, out=out, lse=lse_t, params=params, **(run_kw or {}))
    torch.cuda.synchronize()
    return out.float().cpu().numpy(), (lse_t.cpu().numpy() if lse else None), w


def _check(case, got_o, got_lse, var=ref.Variant(), dtype="bfloat16"):
    from decode_cases import lse_error, rel_error
    want_o, want_lse = case.reference(var)
    err = rel_error(got_o, want_o)
    assert err < TOL[dtype], f"O relative error {err:.2e}"
    if got_lse is not None:
        lerr = lse_error(got_lse, want_lse)
        assert lerr < 2e-2, f"LSE max abs error {lerr:.2e}"


# The neighbourhood's cases (gpu_all.sh's nbhd stage: pytest -m gpu -k nbhd): groups 3, 5, 6 and 7,
# pages 2, 4 and 128, on the tests' own parameters.
def nbhd(*values, id: str):
    return pytest.param(*values, id=f"{id}-nbhd")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (32, 4), (8, 1), nbhd((28, 4), id="28/4"), nbhd((40, 8), id="40/8")],
                         ids=lambda h: f"{h[0]}/{h[1]}")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lengths", ["const:1024", "heavy", "long_short", "uniform:1:64"])
def test_decode_matches_reference(heads, page_size, lengths):
    from decode_cases import kv_lengths, make_case
    rng = np.random.default_rng(hash((heads, page_size, lengths)) % 2**32)
    batch = 17 if lengths != "long_short" else 33
    case = make_case(kv_lengths(lengths, batch, rng), *heads, 128, page_size, seed=int(rng.integers(1 << 30)))
    o, lse, _ = _run(case)
    _check(case, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads, page_size", [pytest.param((16, 4), 16, id="16/4-p16"), nbhd((28, 4), 2, id="28/4-p2"),
                                              nbhd((28, 4), 128, id="28/4-p128"), nbhd((12, 4), 4, id="12/4-p4")])
def test_head_dims_dtypes_layouts(head_dim, dtype, kv_layout, heads, page_size):
    from decode_cases import make_case
    rng = np.random.default_rng(head_dim)
    case = make_case(rng.integers(1, 3000, 9), *heads, head_dim, page_size, dtype=dtype, kv_layout=kv_layout,
                     seed=head_dim)
    o, lse, _ = _run(case, dtype=dtype)
    _check(case, o, lse, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [8, 32, nbhd(2, id="p2"), nbhd(4, id="p4"), nbhd(128, id="p128")])
def test_other_page_sizes(page_size):
    from decode_cases import make_case
    case = make_case([1, 7, 8, 9, 700, 2049], 32, 8, 128, page_size, seed=page_size)
    o, lse, _ = _run(case)
    _check(case, o, lse)


@pytest.mark.gpu
def test_large_batch_and_32k():
    from decode_cases import kv_lengths, make_case
    rng = np.random.default_rng(5)
    case = make_case(kv_lengths("heavy", 256, rng), 32, 8, 128, 16, seed=5)
    o, lse, _ = _run(case)
    _check(case, o, lse)
    case = make_case([32768], 32, 8, 128, 16, seed=6)
    o, lse, _ = _run(case)
    _check(case, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["naive", "batch-invariant"])
def test_plan_modes(mode):
    from decode_cases import make_case
    case = make_case([5000, 30, 1, 4096, 900], 32, 8, 128, 16, seed=11)
    o, lse, _ = _run(case, mode=mode, chunk_tokens=1024)
    _check(case, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "sigmoid"])
@pytest.mark.parametrize("qo_len", [1, 3])
def test_merge_kernel_and_fused_merge(variant, qo_len):
    """Split rows merged by the decode kernel's last-arriving CTA (fused_merge=True) and by the
    separate merge kernel (default) both match the reference; the fused counters are back at
    zero after each kernel, so a second run (and a replan) gives the same bits."""
    import torch
    from decode_cases import make_case
    kv = np.array([9000, 1, 3000, 700, 12000])
    case = make_case(kv, 32, 8, 128, 16, qo_lens=np.minimum(qo_len, kv), seed=31)
    params, var = ({"sigmoid_bias": -1.5}, ref.Variant(sigmoid=True, sigmoid_bias=-1.5)) \
        if variant == "sigmoid" else (None, ref.Variant())
    for fused in (True, False):
        o, lse, w = _run(case, variant=variant, params=params, fused_merge=fused)
        assert w.info.num_merge_rows > 0
        _check(case, o, lse, var)
        w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, qo_indptr=case.qo_indptr)
        again = torch.full_like(case.q, float("nan"))
        w.run(case.q, case.k_cache, case.v_cache, out=again, params=params)
        assert np.array_equal(again.float().cpu().numpy(), o)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("variant", ["plain", "sigmoid", "sinks"])
def test_merge_kernel_with_many_rows(head_dim, variant):
    """More merge jobs of 32 columns than merge warps: the merge kernel takes a (row, head) per
    warp, D/32 columns per lane; every row split, W = 2, 4, 8 columns per lane."""
    from decode_cases import make_case
    # d256 runs one CTA per SM: 16/1 heads give it 132 CTAs per KV head, so 2048 tokens split
    H, Hk = (16, 1) if head_dim == 256 else (32, 2)
    case = make_case(np.full(64, 2048), H, Hk, head_dim, 16, seed=head_dim + 7)
    params, var = None, ref.Variant()
    if variant == "sigmoid":
        params, var = {"sigmoid_bias": -1.5}, ref.Variant(sigmoid=True, sigmoid_bias=-1.5)
    elif variant == "sinks":
        sinks_t, sinks = _sinks(H, 5)
        params, var = {"sinks": sinks_t}, ref.Variant(sinks=sinks)
    o, lse, w = _run(case, variant=variant, params=params)
    assert w.info.num_merge_rows * H * (head_dim // 32) > w.kernels.merge_ctas * 8
    _check(case, o, lse, var)


@pytest.mark.gpu
def test_empty_kv_request_gives_zero_and_neg_inf_lse():
    from decode_cases import make_case
    case = make_case([0, 100, 0, 3000], 8, 2, 128, 16, seed=12)
    o, lse, _ = _run(case)
    assert np.all(o[[0, 2]] == 0) and np.all(np.isneginf(lse[[0, 2]]))
    _check(case, o, lse)


VARIANT_CASES = {
    "causal": (lambda n: {}, ref.Variant(causal=True)),
    "sliding_window": (lambda n: {"window_left": 300}, ref.Variant(window_left=300)),
    "soft_cap": (lambda n: {"soft_cap": 2.0}, ref.Variant(logits_soft_cap=2.0)),
    "sigmoid": (lambda n: {"sigmoid_bias": -1.5}, ref.Variant(sigmoid=True, sigmoid_bias=-1.5)),
    "rope": (lambda n: {"rope_theta": 1e4, "rope_offset": 3}, ref.Variant(rope=True, rope_offset=3)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(VARIANT_CASES) + ["alibi", "custom_mask"])
@pytest.mark.parametrize("qo_len", [1, 3])
def test_variants(variant, qo_len):
    import torch
    from decode_cases import make_case
    rng = np.random.default_rng(21)
    kv = np.array([1, 50, 700, 2500, 5000])
    case = make_case(kv, 16, 4, 128, 16, qo_lens=np.minimum(qo_len, kv), seed=21)
    params, var = variant_params(variant, case, kv, rng)
    o, lse, _ = _run(case, variant=variant, params=params, window_left=var.window_left if var.window_left >= 0 else None)
    _check(case, o, lse, var)


def variant_params(variant: str, case, kv, rng):
    """(run() params, reference Variant) of a built-in variant for `case` (16 query heads)."""
    import torch
    qo = np.diff(case.qo_indptr)
    if variant == "alibi":
        slopes = torch.tensor(ref.alibi_slopes(16), dtype=torch.float32, device="cuda")
        return {"alibi_slopes": slopes}, ref.Variant(alibi=True)
    if variant == "custom_mask":
        masks = [rng.random((q, k)) < 0.7 for q, k in zip(qo, kv)]
        bits, offs = ref.pack_custom_mask(masks)
        params = {"mask": torch.from_numpy(bits).cuda(), "mask_offsets": torch.from_numpy(offs).cuda()}
        return params, ref.Variant(custom_mask=bits, mask_offsets=offs)
    if variant in ("sinks", "sliding_window_sinks"):
        sinks_t, sinks = _sinks(16, 5)
        window = 300 if variant == "sliding_window_sinks" else -1
        return ({"sinks": sinks_t, **({"window_left": window} if window >= 0 else {})},
                ref.Variant(sinks=sinks, window_left=window))
    make, var = VARIANT_CASES[variant]
    return make(None), var


def _sinks(H, seed=0):
    import torch
    x = np.random.default_rng(seed).standard_normal(H) * 2 + 1   # some sinks dominate a short row
    return torch.tensor(x, dtype=torch.float32, device="cuda"), x


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 127, 1000])
@pytest.mark.parametrize("qo_len", [1, 3])
@pytest.mark.parametrize("page_size", [1, 16])
def test_windows_read_only_the_window(window, qo_len, page_size):
    """Sliding windows over long contexts (a decode step and a 3-token step): the plan reads only
    the window (page-rounded), split rows included, and the output equals the reference."""
    from decode_cases import make_case
    kv = np.array([20000, 1, 130, 3000, 1029, 9000])
    case = make_case(kv, 32, 8, 128, page_size, qo_lens=np.minimum(qo_len, kv), seed=51 + qo_len)
    variant = "plain" if window is None else "sliding_window"
    o, lse, w = _run(case, variant=variant, window_left=window)
    _check(case, o, lse, ref.Variant(window_left=-1 if window is None else window))
    if window is not None:
        assert w.info.planned_kv_tokens <= int(np.minimum(kv, window + qo_len + page_size).sum())
        assert w.info.num_merge_rows > 0 or window < 200


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("qo_len", [1, 3])
def test_sinks_fold_once_per_row(window, fused, qo_len):
    """gpt-oss sinks, alone and with a window, on writethrough and split rows (both merge
    paths): O and LSE (the sink in the denominator) equal the float64 reference."""
    from decode_cases import make_case
    kv = np.array([12000, 5, 700, 1, 4000, 0])
    case = make_case(kv, 32, 8, 128, 16, qo_lens=np.maximum(np.minimum(qo_len, kv), 1), seed=61)
    sinks_t, sinks = _sinks(32, 7)
    variant = "sinks" if window is None else "sliding_window_sinks"
    o, lse, w = _run(case, variant=variant, params={"sinks": sinks_t}, window_left=window, fused_merge=fused)
    assert w.info.num_merge_rows > 0
    _check(case, o, lse, ref.Variant(window_left=-1 if window is None else window, sinks=sinks))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cap", [30.0, 1.5])
@pytest.mark.parametrize("heads, page_size", [pytest.param((32, 8), 16, id="32/8-p16"), nbhd((28, 4), 2, id="28/4-p2"),
                                              nbhd((28, 4), 128, id="28/4-p128"), nbhd((48, 8), 4, id="48/8-p4")])
def test_soft_cap_fast_tanh_within_tolerance(head_dim, cap, heads, page_size):
    """tanh.approx.f32 against float64: O and LSE inside the bf16 tolerance, logits large
    enough (q scaled by 4) that the cap bites."""
    from decode_cases import make_case
    case = make_case([3000, 17, 900, 6000], *heads, head_dim, page_size, seed=head_dim)
    case.q = case.q * 4
    o, lse, _ = _run(case, variant="soft_cap", params={"soft_cap": cap})
    _check(case, o, lse, ref.Variant(logits_soft_cap=cap))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 2), (32, 1), (64, 4), nbhd((28, 4), id="28/4"), nbhd((40, 8), id="40/8")],
                         ids=lambda h: f"{h[0]}/{h[1]}")
@pytest.mark.parametrize("variant", ["plain", "soft_cap", "sliding_window_sinks"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_wide_groups_and_token_pages(heads, variant, page_size):
    """g = 16 and 32 (one and two 16-row tiles), and the neighbourhood's g = 7 and 5 (rows left over in a
    16-row tile), with every new variant, page sizes 1 and 16."""
    from decode_cases import make_case
    rng = np.random.default_rng(heads[1] * 10 + page_size)
    case = make_case(rng.integers(1, 5000, 13), *heads, 128, page_size, seed=int(rng.integers(1 << 30)))
    params, var, window = None, ref.Variant(), None
    if variant == "soft_cap":
        params, var = {"soft_cap": 20.0}, ref.Variant(logits_soft_cap=20.0)
    elif variant == "sliding_window_sinks":
        sinks_t, sinks = _sinks(heads[0], 3)
        params, var, window = {"sinks": sinks_t}, ref.Variant(window_left=500, sinks=sinks), 500
    o, lse, _ = _run(case, variant=variant, params=params, window_left=window)
    _check(case, o, lse, var)


@pytest.mark.gpu
def test_user_defined_variant():
    """A variant that is not built in: logits scaled by a per-head temperature tensor."""
    import torch
    from decode_cases import make_case
    source = """
    struct HeadTemperature : rtattn::VariantBase {
      static constexpr bool has_logits_transform = true;
      template <class P> __device__ float LogitsTransform(const P& p, float s, int, int, int qo_head, int) const {
        return s * p.extra.temperature[qo_head];
      }
    };"""
    spec = S.custom_variant("head_temp", source, "HeadTemperature", (S.Param("temperature", "const float*"),))
    case = make_case([10, 600, 2000], 8, 2, 128, 16, seed=31)
    temp = np.linspace(0.5, 2.0, 8)
    o, lse, _ = _run(case, variant=spec, params={"temperature": torch.tensor(temp, dtype=torch.float32, device="cuda")})
    # same as plain attention with sm_scale multiplied per head: check head by head
    want_o, want_lse = case.reference(ref.Variant())
    from decode_cases import rel_error
    for h in range(8):
        wo, _ = case.reference(ref.Variant(sm_scale=temp[h] / np.sqrt(128)))
        assert rel_error(o[:, h], wo[:, h]) < 2e-2


@pytest.mark.gpu
def test_outputs_are_bitwise_deterministic():
    import torch
    from decode_cases import kv_lengths, make_case
    case = make_case(kv_lengths("heavy", 64, np.random.default_rng(3)), 32, 8, 128, 16, seed=3)
    o1, l1, w = _run(case)
    outs = []
    for _ in range(3):
        out = torch.full_like(case.q, float("nan"))
        w.run(case.q, case.k_cache, case.v_cache, out=out)
        outs.append(out.view(torch.int16).cpu().numpy())
    assert all(np.array_equal(outs[0], x) for x in outs[1:])
    assert np.array_equal(outs[0], torch.from_numpy(o1).to(torch.bfloat16).view(torch.int16).numpy())


@pytest.mark.gpu
def test_batch_invariant_mode_is_independent_of_batch():
    import torch
    from decode_cases import make_case
    case = make_case([7000, 10, 3000], 32, 8, 128, 16, seed=41)
    o_full, _, _ = _run(case, mode="batch-invariant", chunk_tokens=1024)
    # the same first request alone (same pages, same data)
    n0 = int(case.kv_indptr[1])
    alone = make_case([7000], 32, 8, 128, 16, seed=41)
    alone.q, alone.k_cache, alone.v_cache = case.q[:1], case.k_cache, case.v_cache
    alone.kv_indices = case.kv_indices[:n0]
    o_alone, _, _ = _run(alone, mode="batch-invariant", chunk_tokens=1024)
    assert np.array_equal(o_full[0], o_alone[0])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(INVARIANT_CASES))
def test_batch_invariant_bitwise_across_companions_and_shapes(name):
    """Chunk runs on the GPU (decode_cases.INVARIANT_CASES): request 0's O and LSE bits are the
    same alone, among short requests and among all (it is split differently in each), and the
    full batch matches the float64 reference."""
    from decode_cases import check_invariant_case
    r = check_invariant_case(INVARIANT_CASES[name])
    assert r["splits"] > 1, r   # the check means something: request 0's items differ
    assert r["bitwise"], r
    assert r["o_err"] < TOL["bfloat16"] and r["lse_err"] < 2e-2, r


@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [8, 4])
def test_batch_invariant_default_chunk_bitwise_across_companions(hkv):
    """Default chunk: request 0 (split into several chunks) gives bitwise the same
    O and LSE alone, among short requests, among long ones, eagerly and from a captured graph,
    and matches the float64 reference."""
    import torch
    from decode_cases import lse_error, make_case, rel_error
    from rtattn.graphs import StepGraph
    from rtattn.runtime import Stream
    from rtattn.wrapper import BatchDecodeWrapper
    lens = [9000, 10, 300, 77, 20000, 5000, 1500, 4096]
    case = make_case(lens, 32, hkv, 128, 16, seed=29 + hkv)
    pages = [case.kv_indices[case.kv_indptr[b]:case.kv_indptr[b + 1]] for b in range(len(lens))]
    w = BatchDecodeWrapper(32, hkv, 128, 16, max_batch=len(lens), max_pages=int(case.kv_indptr[-1]),
                           mode="batch-invariant")
    assert w.planner.bounds.chunk_tokens < 9000            # request 0 is split
    s = Stream()
    got = []
    for subset in ([0], [0, 1, 2, 3], [0, 4, 5, 6, 7], list(range(8))):
        sel = torch.tensor(subset, device="cuda")
        kv_indptr = np.concatenate([[0], np.cumsum([len(pages[b]) for b in subset])]).astype(np.int32)
        w.plan(kv_indptr, np.concatenate([pages[b] for b in subset]), case.kv_last_page_len[subset], stream=s)
        q = case.q[sel].contiguous()
        o = torch.full_like(q, float("nan"))
        lse = torch.full((len(subset), 32), float("nan"), device="cuda")
        w.run(q, case.k_cache, case.v_cache, out=o, lse=lse, stream=s)
        s.synchronize()
        got.append((o[0].view(torch.int16).cpu().numpy(), lse[0].cpu().numpy().view(np.int32)))
        if len(subset) == 8:   # the same from a graph
            o2, lse2 = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
            with StepGraph([w.prepare(q, case.k_cache, case.v_cache, out=o2, lse=lse2, stream=s)], s) as sg:
                sg.replay()
                s.synchronize()
            assert torch.equal(o2.view(torch.int16), o.view(torch.int16)) and torch.equal(lse2, lse)
            want_o, want_lse = case.reference()
            assert rel_error(o.float().cpu().numpy(), want_o) < TOL["bfloat16"]
            assert lse_error(lse.cpu().numpy(), want_lse) < 2e-2
    for o0, l0 in got[1:]:
        assert np.array_equal(o0, got[0][0]) and np.array_equal(l0, got[0][1])
