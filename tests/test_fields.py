import re
import struct

import numpy as np
import pytest

from rtattn.plan import fields as F


def _bounds(**kw):
    d = dict(max_batch=64, max_qo_tokens=256, max_pages=4096, num_ctas=33, tile_q=4)
    d.update(kw)
    return F.PlanBounds(**d)


def test_field_order_is_the_contract():
    assert F.FIELD_NAMES == (
        "req_qo_start", "req_qo_len", "req_kv_page_start", "req_kv_len", "kv_indices",
        "work_indptr", "item_request", "item_qo_start", "item_qo_len", "item_kv_start",
        "item_kv_end", "item_partial", "item_merge", "item_kv_page_start", "merge_indptr", "merge_qo_row",
        "merge_partial_start", "merge_partial_stride", "plan_info")
    assert all(f.dtype == np.int32 for f in F.PLAN_FIELDS)


@pytest.mark.parametrize("mode", F.MODES)
def test_offsets_aligned_disjoint_and_capacities(mode):
    b = _bounds(mode=mode, page_size=16, chunk_tokens=2048)
    lay = F.PlanLayout(b)
    prev_end = 0
    for name, dtype, cap, off, formula in lay.table():
        assert off % F.ALIGN == 0
        assert off >= prev_end
        prev_end = off + cap * 4
    assert lay.plan_bytes >= prev_end and lay.plan_bytes % F.ALIGN == 0
    assert lay.capacity["work_indptr"] == b.num_ctas + 1
    assert lay.capacity["item_request"] == b.max_items
    assert lay.capacity["merge_partial_start"] == b.max_merge_rows
    assert lay.capacity["merge_indptr"] == b.max_merge_rows + 1
    assert lay.capacity["plan_info"] == F.PLAN_INFO_LEN


def test_balanced_bounds_formulas():
    b = _bounds()
    assert b.max_tiles == min(256, 256 // 4 + 64)
    assert b.max_items == 33 + b.max_tiles
    assert b.max_partial_rows == 2 * 33 * 4
    assert b.max_merge_rows == min(33 * 4, 256)
    n = _bounds(mode="naive")
    assert n.max_items == n.max_tiles and n.max_partial_rows == 0 and n.max_merge_rows == 0


def test_batch_invariant_bounds_need_page_multiple_chunk():
    with pytest.raises(ValueError, match="chunk_tokens"):
        _bounds(mode="batch-invariant", page_size=16, chunk_tokens=100)
    b = _bounds(mode="batch-invariant", page_size=16, chunk_tokens=2048, max_qo_len=1)
    k = -(-4096 * 16 // 2048)
    assert b.max_items == min(b.max_tiles * k, b.max_tiles + -(-4096 * 16 // 2048))
    assert b.max_partial_rows == min(256 * k, -(-2 * 1 * 4096 * 16 // 2048))


def test_views_alias_one_buffer():
    lay = F.PlanLayout(_bounds())
    buf = lay.allocate()
    v = lay.views(buf)
    v["item_kv_end"][3] = 12345
    off = lay.offsets["item_kv_end"] + 3 * 4
    assert int(buf[off:off + 4].view(np.int32)[0]) == 12345
    with pytest.raises(ValueError, match="plan_bytes"):
        lay.views(np.zeros(lay.plan_bytes - 1, np.uint8))
    # memoryview / bytearray (e.g. pinned memory exposed through the buffer protocol)
    ba = bytearray(lay.plan_bytes)
    lay.views(ba)["plan_info"][0] = 7
    assert ba[lay.offsets["plan_info"]] == 7


def test_c_struct_matches_pack():
    text = F.c_struct()
    members = re.findall(r"const int32_t\* (\w+);", text)
    assert tuple(members) == F.FIELD_NAMES
    assert text.splitlines()[1] == "struct PlanPtrs {"
    lay = F.PlanLayout(_bounds())
    base = 0x7F0000000000
    packed = lay.pack_plan_ptrs(base)
    assert len(packed) == 8 * len(F.PLAN_FIELDS)
    ptrs = struct.unpack(f"<{len(F.PLAN_FIELDS)}Q", packed)
    assert ptrs == tuple(base + lay.offsets[n] for n in F.FIELD_NAMES)
    with pytest.raises(ValueError, match="aligned"):
        lay.pack_plan_ptrs(base + 8)


def test_workspace_partial_regions():
    b = _bounds()
    lay = F.PlanLayout(b)
    H, D = 32, 128
    po = lay.partial_o_offset()
    pl = lay.partial_lse_offset(H, D)
    assert po >= lay.plan_bytes and po % 256 == 0 and pl % 256 == 0
    assert pl >= po + b.max_partial_rows * H * D * 4
    # a batch-invariant partial row keeps its unnormalized (m, l) pair: two floats per row
    mc = lay.merge_counters_offset(H, D)
    assert mc % 256 == 0 and mc >= pl + b.max_partial_rows * H * 8
    assert lay.workspace_bytes(H, D) >= mc + b.max_merge_rows * H * 4


def test_bad_bounds_named():
    with pytest.raises(ValueError, match="max_batch"):
        _bounds(max_batch=0)
    with pytest.raises(ValueError, match="mode"):
        _bounds(mode="fast")
