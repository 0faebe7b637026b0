import pytest

from rtattn.plan.devices import DEVICES, from_props, get_device
from rtattn.codegen.spec import standard
from rtattn.families.decode import smem_bytes
from rtattn.plan.tiles import TileConfig, num_ctas_for, occupancy, select_tile


def test_named_devices():
    assert get_device("h200").sm_count == 132 and get_device("H100").l2_bytes == 50 * 2**20
    a = get_device("a100")
    assert a.sm_count == 108 and a.smem_per_sm == 164 * 1024 and a.cc == (8, 0)
    with pytest.raises(ValueError, match="unknown device"):
        get_device("tpu")


def test_from_props_duck_typed():
    class P:
        name, sm_count, smem_per_sm, smem_per_block_optin = "NVIDIA H200", 132, 233472, 232448
        regs_per_sm, l2_bytes, cc = 65536, 62914560, (9, 0)
    d = from_props(P())
    assert d.sm_count == 132 and d.cc == (9, 0)
    assert get_device(P()).name == "NVIDIA H200"
    with pytest.raises(TypeError):
        from_props(object())


def test_decode_tile_head_group_fusion():
    t = select_tile("h200", 32, 8, 128, max_qo_len=512)
    assert t.tile_q == 4 and t.max_rows == 16 and t.tile_kv == 64 and t.stages == 3
    assert t.smem_bytes == 103936 and t.ctas_per_sm == 2   # the d128 kernel (cuda_src/decode.cuh)
    assert select_tile("h200", 32, 8, 128, max_qo_len=1).tile_q == 1   # capped by q length
    assert select_tile("h200", 32, 32, 128, max_qo_len=64).tile_q == 16
    assert select_tile("h200", 32, 4, 128, max_qo_len=64, max_rows=32).tile_q == 4
    t256 = select_tile("h200", 32, 8, 256, max_qo_len=4)
    assert (t256.tile_kv, t256.stages, t256.smem_bytes, t256.ctas_per_sm) == (64, 3, 206336, 1)
    assert select_tile("h200", 32, 4, 64).ctas_per_sm == 3     # 164 registers, 52.7 KB
    a256 = select_tile("a100", 32, 8, 256, max_qo_len=4)   # 3 stages exceed A100's opt-in
    assert a256.stages == 2 and a256.ctas_per_sm == 1
    with pytest.raises(ValueError, match="exceeds max_rows"):
        select_tile("h200", 64, 1, 128, max_rows=16)


def test_occupancy_limits():
    h = get_device("h200")
    assert occupancy(h, 128, 168, smem_bytes(standard())) == 2     # smem bound
    assert occupancy(h, 128, 255, 4096) == 2                         # register bound
    assert occupancy(h, 128, 168, 300 * 1024) == 0                   # over opt-in
    assert occupancy(get_device("a100"), 128, 168, smem_bytes(standard())) == 1


def test_num_ctas():
    t = select_tile("h200", 32, 8, 128)
    assert num_ctas_for("h200", t, 8) == 132 * t.ctas_per_sm // 8
    assert num_ctas_for("h200", t, 10**6) == 1


def test_prefill_tile():
    t = select_tile("h200", 32, 8, 128, max_qo_len=512, kernel="prefill")
    assert t.kernel == "prefill" and t.max_rows in (16, 32, 64, 128)
    assert t.tile_q * 4 <= t.max_rows and t.tile_kv in (32, 64, 128)
    assert t.ctas_per_sm >= 1
    small = select_tile("h200", 32, 8, 128, max_qo_len=512, avg_qo_len=3, kernel="prefill")
    assert small.max_rows == 16
    assert isinstance(t, TileConfig)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_planner_and_renderer_read_one_decode_resource_model(arch):
    """Every shipped decode instance: the planner's tile (plan.tiles -> families.decode) has the
    shared memory and stages the source is rendered (and static_asserted) with, on the arch's
    device; the kernel is compiled for the CTAs that shared memory lets reside."""
    from rtattn.families import decode as family
    from rtattn.families.resources import blocks_by_smem, device_for_arch
    dev = device_for_arch(arch)
    for spec in family.shipped(arch):
        r = family.render(spec, dev)
        t = select_tile(dev, spec.rows, 1, spec.head_dim, max_qo_len=1, max_rows=spec.rows, invariant=spec.invariant)
        assert (t.smem_bytes, t.stages) == (r.smem_bytes, spec.stages), spec.uri
        assert f"__launch_bounds__({r.threads}, {blocks_by_smem(dev, r.smem_bytes, 2)})" in r.source
        assert f"== {r.smem_bytes}" in r.source   # the static_assert against rtattn::DecodeShape
