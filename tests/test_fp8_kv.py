"""fp8 KV caches (e4m3fn, e5m2): the spec's element types and kernel names, compilation for sm_80
and sm_90, the wrapper's refusals and scale packing (CPU tier); the kernels against a float64
reference over the dequantized cache (GPU tier).

GPU tolerance: the reference attends over exactly the values the kernel multiplies (fp8 codes x
scales; every fp8 value is exact in fp16, the products accumulate in fp32), so no quantization
error enters the comparison. What remains is P rounded to fp16 (2^-11 relative) and O rounded
to its output type: bf16 keeps 8 significant bits (relative error norm ~1.7e-3 from the rounding
alone), fp16 11. Hence 5e-3 for bf16 outputs and 1.5e-3 for fp16 ones, about 3x the rounding
floor. Variants whose hooks round or approximate on their own (RoPE rounds the rotated q to q's
type; soft-cap's tanh) keep the 16-bit tier's 2e-2. LSE: 2e-3 absolute (fp32 logits)."""
from __future__ import annotations

import numpy as np
import pytest

from rtattn.codegen import spec as S
from rtattn.codegen.render import params_struct
from rtattn.families import decode as decode_family
from rtattn.families.decode import smem_bytes as decode_smem_bytes
from rtattn.kernels import compile_spec
from rtattn.plan import reference as ref

FP8 = ["float8_e4m3fn", "float8_e5m2"]


# ----------------------------------------------------------------------------- CPU tier
def test_element_types_are_separate_fields_and_dtype_still_works():
    s = S.standard(dtype="float16")
    assert (s.dtype, s.q_dtype, s.kv_dtype, s.o_dtype) == ("float16",) * 4
    assert s.uri == "plain_float16_d128_m1_w4_s3" and not s.kv_is_fp8
    f = S.standard(kv_dtype="e4m3")                      # aliases resolve to the DLPack names
    assert (f.q_dtype, f.kv_dtype, f.o_dtype) == ("bfloat16", "float8_e4m3fn", "bfloat16") and f.kv_is_fp8
    assert f.uri == "plain_bfloat16_kve4m3_d128_m1_w4_s3"
    g = S.sigmoid(q_dtype="float16", kv_dtype="float8_e5m2", o_dtype="bfloat16", head_dim=64)
    assert g.uri == "sigmoid_float16_kve5m2_obfloat16_d64_m1_w4_s3" and g.dtype == "float16"
    # with_(dtype=) moves q and whatever followed it; an fp8 cache stays fp8
    assert f.with_(dtype="float16").uri == "plain_float16_kve4m3_d128_m1_w4_s3"
    assert s.with_(dtype="bfloat16") == S.standard()
    assert f.with_(m_tiles=2) == S.standard(kv_dtype="float8_e4m3fn", m_tiles=2)


@pytest.mark.parametrize("kw, match", [
    (dict(kv_dtype="float32"), "kv_dtype"), (dict(q_dtype="float8_e4m3fn"), "q_dtype"),
    (dict(o_dtype="e5m2"), "o_dtype"), (dict(dtype="float16", q_dtype="bfloat16"), "disagree")])
def test_bad_element_types_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        S.standard(**kw)


def test_shipped_fp8_instances_are_named_and_sized():
    names = [s.uri for s in decode_family.shipped("sm_90")]
    e4m3, e5m2 = ([n for n in names if f"_kv{f}_" in n] for f in ("e4m3", "e5m2"))
    assert len(e4m3) == len(S.BUILTINS) * len(S.HEAD_DIMS) and len(set(names)) == len(names)
    assert e5m2 == [f"plain_bfloat16_kve5m2_d{d}_m1_w4_s3" for d in S.HEAD_DIMS]
    assert "rope_bfloat16_kve4m3_d256_m1_w4_s2" in [s.uri for s in decode_family.shipped("sm_80")]
    # half the KV bytes per stage, but a stage also holds the warps' float32 combine: same size
    assert decode_smem_bytes(S.standard(kv_dtype="e4m3")) == decode_smem_bytes(S.standard())
    members = [m.name for m in params_struct(S.standard(kv_dtype="e5m2")).members]
    assert {"k_scale", "v_scale", "k_scale_stride", "v_scale_stride", "k_scale_f", "v_scale_f"} <= set(members)
    assert "k_scale" not in [m.name for m in params_struct(S.standard()).members]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("spec", [S.standard(kv_dtype="e4m3"), S.rope(kv_dtype="e5m2", dtype="float16", head_dim=64),
                                  S.standard(soft_cap=True, kv_dtype="e4m3", head_dim=256)], ids=lambda s: s.uri)
def test_fp8_instances_compile(spec, arch, isolated_cache):
    rendered, cubin = compile_spec(spec, arch, quiet=True)
    assert cubin[:4] == b"\x7fELF" and "rtattn::Fp8E" in rendered.source


def test_software_conversion_compiles_for_sm_90(isolated_cache, monkeypatch):
    monkeypatch.setenv("RTATTN_DEV_DEFINES", "-DRTATTN_FP8_SOFTWARE")
    _, cubin = compile_spec(S.standard(kv_dtype="e4m3"), "sm_90", quiet=True)
    assert cubin[:4] == b"\x7fELF"


# wrapper validation and packing, on the fake GPU of tests/fakes.py
@pytest.fixture
def fake_gpu(monkeypatch):
    import fakes
    made = []
    fakes.install(monkeypatch, lambda spec: made.append(fakes.FakeKernels(spec)) or made[-1])
    return made


def _cuda(shape, dtype, ptr):
    from rtattn.runtime import export
    return export(ptr, shape, dtype, 0)


def _planned(kv_dtype="float8_e4m3fn", **kw):
    from rtattn.plan.layout import paged_kv
    from rtattn.wrapper import BatchDecodeWrapper
    w = BatchDecodeWrapper(32, 8, 128, 16, max_batch=4, max_pages=64, kv_dtype=kv_dtype, **kw)
    w.plan(*paged_kv([100, 20], 16))
    return w


def _tensors(kv="float8_e4m3fn"):
    return (_cuda((2, 32, 128), "bfloat16", 1 << 30), _cuda((40, 16, 8, 128), kv, 1 << 32),
            _cuda((40, 16, 8, 128), kv, 1 << 33), _cuda((2, 32, 128), "bfloat16", 1 << 34))


def test_scales_are_packed_per_tensor_and_per_head(fake_gpu):
    w = _planned()
    assert w.spec.uri == "plain_bfloat16_kve4m3_d128_m1_w4_s3" and w.kv_dtype == "float8_e4m3fn"
    q, k, v, o = _tensors()
    ks, vs = _cuda((8,), "float32", 1 << 35), _cuda((1,), "float32", 1 << 36)
    w.run(q, k, v, out=o, k_scale=ks, v_scale=vs)
    w.run(q, k, v, out=o, k_scale=0.25)
    w.run(q, k, v, out=o)   # no scales: per-tensor 1.0, nothing left from the calls before
    st = [w.kernels.rendered.params.ctypes_type().from_buffer_copy(p) for p in fake_gpu[0].launches]
    assert (st[2].k_scale, st[2].v_scale, st[2].k_scale_stride, st[2].k_scale_f, st[2].v_scale_f) == \
        (None, None, 0, 1.0, 1.0)
    assert (st[0].k_scale, st[0].k_scale_stride, st[0].v_scale, st[0].v_scale_stride) == (ks.ptr, 1, vs.ptr, 0)
    assert (st[0].k_scale_f, st[0].v_scale_f) == (1.0, 1.0)
    assert (st[1].k_scale, st[1].v_scale, st[1].k_scale_f, st[1].v_scale_f) == (None, None, 0.25, 1.0)
    assert (st[0].k_cache, st[0].k_stride_page, st[0].k_stride_tok) == (k.ptr, 16 * 8 * 128, 8 * 128)


@pytest.mark.parametrize("case, exc, match", [
    ("bf16 cache, fp8 wrapper", TypeError, r"k_cache has dtype bfloat16.*kv_dtype=float8_e4m3fn"),
    ("fp8 cache, bf16 wrapper", TypeError, r"k_cache has dtype float8_e4m3fn.*kv_dtype='float8_e4m3fn'"),
    ("e5m2 cache, e4m3 wrapper", TypeError, r"v_cache has dtype float8_e5m2"),
    ("scale on a bf16 cache", ValueError, r"k_scale applies to fp8"),
    ("scale shape", ValueError, r"k_scale has shape \[4\], expected \[1\].*\[8\]"),
    ("scale dtype", TypeError, r"v_scale has dtype float16"),
    ("scale on the host", ValueError, r"k_scale"),
    ("scale not finite", ValueError, r"v_scale=nan"),
])
def test_bad_caches_and_scales_are_refused_before_launch(fake_gpu, case, exc, match):
    q, k, v, o = _tensors()
    kw, wrapper_kv = {}, "float8_e4m3fn"
    if case == "bf16 cache, fp8 wrapper":
        _, k, v, _ = _tensors("bfloat16")
    elif case == "fp8 cache, bf16 wrapper":
        wrapper_kv = None
    elif case == "e5m2 cache, e4m3 wrapper":
        v = _tensors("float8_e5m2")[2]
    elif case == "scale on a bf16 cache":
        wrapper_kv, (_, k, v, _), kw = None, _tensors("bfloat16"), dict(k_scale=0.5)
    elif case == "scale shape":
        kw = dict(k_scale=_cuda((4,), "float32", 1 << 35))
    elif case == "scale dtype":
        kw = dict(v_scale=_cuda((8,), "float16", 1 << 35))
    elif case == "scale on the host":
        kw = dict(k_scale=np.ones(8, np.float32))
    else:
        kw = dict(v_scale=float("nan"))
    w = _planned(wrapper_kv)
    with pytest.raises(exc, match=match):
        w.run(q, k, v, out=o, **kw)
    assert not fake_gpu[0].launches


def test_spec_with_other_element_types_is_refused(fake_gpu):
    with pytest.raises(ValueError, match="kv_dtype=float8_e5m2.*kv_dtype=float8_e4m3fn"):
        _planned(variant=S.standard(kv_dtype="e5m2"))


# ----------------------------------------------------------------------------- GPU tier
def _tol(o_dtype: str, variant: str = "plain") -> float:
    if variant in ("rope", "soft_cap"):
        return 2e-2
    return 5e-3 if o_dtype == "bfloat16" else 1.5e-3


def _run(case, kv_dtype, k_scale, v_scale, **kw):
    """test_decode._run on an fp8 cache with its scales (poisoned outputs, LSE)."""
    from test_decode import _run as run16
    return run16(case, kv_dtype=kv_dtype, run_kw=dict(k_scale=k_scale, v_scale=v_scale), **kw)


def _lse_tol(case, var) -> float:
    """2e-3, plus for RoPE the rounding of the rotated q and K to 16 bits before the dot (K cannot
    stay fp8 once rotated): |d logit| <= sm_scale * 2^-8 * |q_i| |k_j| (rotation keeps norms), so
    the LSE moves by at most that over the largest q and K. fp8 codes drawn from every finite code
    make |k| up to ~10x a unit-normal K's, which is why this is needed here and not for bf16."""
    if not var.rope:
        return 2e-3
    q = case.q.float().cpu().numpy().astype(np.float64)
    sm_scale = var.sm_scale if var.sm_scale is not None else q.shape[-1] ** -0.5
    q_norm = np.linalg.norm(q, axis=-1).max()
    k_norm = np.linalg.norm(case.k_ref, axis=-1).max()
    return 2e-3 + sm_scale * 2.0 ** -8 * q_norm * k_norm


def _check(case, o, lse, tol, var=ref.Variant()):
    from decode_cases import lse_error, rel_error
    want_o, want_lse = case.reference(var)
    err, lerr = rel_error(o, want_o), lse_error(lse, want_lse)
    assert err < tol, f"O relative error {err:.2e} (tolerance {tol:.1e})"
    lse_tol = _lse_tol(case, var)
    assert lerr < lse_tol, f"LSE max abs error {lerr:.2e} (tolerance {lse_tol:.1e})"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype, head_dim, scales, kv_layout", [
    ("bfloat16", 128, "head", "NHD"), ("bfloat16", 64, "tensor", "NHD"), ("bfloat16", 256, "float", "HND"),
    ("float16", 128, "float", "HND"), ("float16", 64, "head", "NHD")])
def test_fp8_matches_dequantized_reference(kv_dtype, dtype, head_dim, scales, kv_layout):
    from decode_cases import fp8_case, make_case
    case = make_case([1, 17, 700, 3000, 9000], 32, 8, head_dim, 16, dtype=dtype, kv_layout=kv_layout, seed=head_dim)
    case, ks, vs = fp8_case(case, kv_dtype, scales, seed=head_dim)
    o, lse, w = _run(case, kv_dtype, ks, vs, dtype=dtype)
    assert w.info.num_merge_rows > 0      # the 9000-token request is split: the merge sees fp8 partials
    _check(case, o, lse, _tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("heads, page_size", [((32, 32), 1), ((32, 4), 16), ((8, 1), 64), ((32, 1), 16)],
                         ids=lambda x: str(x))
def test_fp8_head_groups_and_page_sizes(heads, page_size):
    from decode_cases import fp8_case, kv_lengths, make_case
    rng = np.random.default_rng(page_size)
    case = make_case(kv_lengths("heavy", 19, rng), *heads, 128, page_size, seed=7)
    case, ks, vs = fp8_case(case, "float8_e4m3fn", "head", seed=7)
    o, lse, _ = _run(case, "float8_e4m3fn", ks, vs)
    _check(case, o, lse, _tol("bfloat16"))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["causal", "sliding_window", "soft_cap", "sigmoid", "rope", "alibi", "custom_mask",
                                     "sinks", "sliding_window_sinks"])
def test_fp8_every_variant(variant):
    from decode_cases import fp8_case, make_case
    from test_decode import variant_params
    kv = np.array([1, 50, 700, 2500, 5000])
    case = make_case(kv, 16, 4, 128, 16, qo_lens=np.minimum(3, kv), seed=21)
    case, ks, vs = fp8_case(case, "float8_e4m3fn", "head", seed=21)
    params, var = variant_params(variant, case, kv, np.random.default_rng(21))
    o, lse, _ = _run(case, "float8_e4m3fn", ks, vs, variant=variant, params=params,
                     window_left=var.window_left if var.window_left >= 0 else None)
    _check(case, o, lse, _tol("bfloat16", variant), var)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_software_conversion(kv_dtype, monkeypatch):
    """The sm_80 conversion (byte permutes, shifts, masks), forced on this GPU."""
    from decode_cases import fp8_case, make_case
    from rtattn.kernels import decode_kernels
    monkeypatch.setenv("RTATTN_DEV_DEFINES", "-DRTATTN_FP8_SOFTWARE")
    decode_kernels.cache_clear()
    try:
        case = make_case([5, 900, 4000], 32, 8, 128, 16, seed=3)
        case, ks, vs = fp8_case(case, kv_dtype, "head", seed=3)
        o, lse, _ = _run(case, kv_dtype, ks, vs)
        _check(case, o, lse, _tol("bfloat16"))
    finally:
        decode_kernels.cache_clear()


@pytest.mark.gpu
def test_fp8_deterministic_fused_merge_and_graphs():
    """Same bits on every run, from the merge kernel and the fused merge alike, and from a
    DecodeGraphs replay with per-head scale tensors."""
    import torch
    from decode_cases import fp8_case, make_case
    from rtattn.graphs import DecodeGraphs
    case = make_case([9000, 1, 3000, 700, 12000], 32, 8, 128, 16, seed=31)
    case, ks, vs = fp8_case(case, "float8_e4m3fn", "head", seed=31)
    o, lse, w = _run(case, "float8_e4m3fn", ks, vs)
    _check(case, o, lse, _tol("bfloat16"))
    bits = torch.from_numpy(o).to(torch.bfloat16).view(torch.int16).numpy()
    for _ in range(2):
        again = torch.full_like(case.q, float("nan"))
        w.run(case.q, case.k_cache, case.v_cache, out=again, k_scale=ks, v_scale=vs)
        assert np.array_equal(again.view(torch.int16).cpu().numpy(), bits)
    fo, _, _ = _run(case, "float8_e4m3fn", ks, vs, fused_merge=True)
    _check(case, fo, lse, _tol("bfloat16"))
    s = torch.cuda.Stream()
    g = DecodeGraphs(w, max_execs=1)
    out = torch.full_like(case.q, float("nan"))
    g.step(case.q, case.k_cache, case.v_cache, out=out, stream=s, k_scale=ks, v_scale=vs)
    s.synchronize()
    assert np.array_equal(out.view(torch.int16).cpu().numpy(), bits)
