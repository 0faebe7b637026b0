"""Cascade levels: their union as one pseudo-batch, positions, and the refusals."""
from __future__ import annotations

import numpy as np
import pytest

from rtattn.plan.levels import Level, check_against_requests, union_batch
from rtattn.plan.prefix_tree import share_prefixes

from cascade_cases import one_prefix_batch

PS = 16


def _two_levels():
    kv_indptr, idx, last, _ = one_prefix_batch(3, 48, 20, PS)
    return share_prefixes(kv_indptr, idx, last, PS), (kv_indptr, idx, last)


def test_union_lays_levels_end_to_end_with_absolute_positions():
    lv, _ = _two_levels()
    u = union_batch(lv, PS)
    assert u.num_levels == 2 and u.num_qo_tokens == 3
    assert u.batch.qo_indptr.tolist() == [0, 3, 4, 5, 6] and u.row_shift.tolist() == [0, 3, 3, 3]
    assert u.level_of.tolist() == [0, 1, 1, 1]
    prefix = int(np.diff(lv[0].kv_indptr)[0]) * PS
    assert u.kv_offset.tolist() == [0, prefix, prefix, prefix]
    suffix = int(u.batch.kv_len[1])
    assert u.q_pos.tolist() == [prefix + suffix - 1] * 3


def test_groups_must_hold_whole_requests():
    qo = np.array([0, 2, 5, 6], np.int32)
    top = Level(np.array([0, 3, 6], np.int32), np.array([0, 1, 1], np.int32), np.array([4], np.int32),
                np.array([PS, PS], np.int32))
    last = Level(qo, np.array([0, 1, 2, 3], np.int32), np.array([1, 2, 3], np.int32), np.ones(3, np.int32))
    with pytest.raises(ValueError, match=r"level 0: group 1 starts at query row 3 .* inside request 1"):
        union_batch([top, last], PS)


def test_levels_must_cover_the_same_queries_and_nest():
    last = Level(np.array([0, 1, 2], np.int32), np.array([0, 1, 2], np.int32), np.array([1, 2], np.int32),
                 np.ones(2, np.int32))
    short = Level(np.array([0, 1], np.int32), np.array([0, 1], np.int32), np.array([4], np.int32),
                  np.array([PS], np.int32))
    with pytest.raises(ValueError, match="level 0 covers 1 query rows"):
        union_batch([short, last], PS)
    # request 0 has a page in level 0, request 1 none: a shared level-1 group is at two positions
    l0 = Level(np.array([0, 1, 2], np.int32), np.array([0, 1, 1], np.int32), np.array([4], np.int32),
               np.array([PS, PS], np.int32))
    l1 = Level(np.array([0, 2], np.int32), np.array([0, 1], np.int32), np.array([5], np.int32),
               np.array([PS], np.int32))
    with pytest.raises(ValueError, match="level 1: group 0's requests reach it at different positions"):
        union_batch([l0, l1, last], PS)


def test_page_table_errors_name_the_level_and_limits_hold():
    lv, _ = _two_levels()
    bad = lv[0]._replace(kv_last_page_len=np.array([PS + 1], np.int32))
    with pytest.raises(ValueError, match=r"level 0: kv_last_page_len\[0\] = 17"):
        union_batch([bad, lv[1]], PS)
    with pytest.raises(ValueError, match="3 levels exceed num_levels=2"):
        union_batch([lv[0], lv[0], lv[1]], PS, max_levels=2)
    with pytest.raises(ValueError, match=r"level 0: kv_indices\[0\] = .* outside the page pool"):
        union_batch(lv, PS, num_pages=1)


def test_causal_queries_must_sit_in_the_last_level():
    kv_indptr, idx, last, _ = one_prefix_batch(2, 64, 3, PS)
    lv = share_prefixes(kv_indptr, idx, last, PS, np.array([0, 2, 6], np.int32))
    union_batch(lv, PS)   # not causal: fine
    with pytest.raises(ValueError, match="causal: request 1 has 4 queries but its last level holds 3"):
        union_batch(lv, PS, causal=True)


def test_levels_are_checked_against_the_requests_page_tables():
    lv, req = _two_levels()
    check_against_requests(lv, *req, PS)
    swapped = lv[1]._replace(kv_indices=lv[1].kv_indices[::-1].copy())
    with pytest.raises(ValueError, match="request 0: level 1 group 0 page 0"):
        check_against_requests([lv[0], swapped], *req, PS)
    long = lv[0]._replace(kv_indptr=np.array([0, 6], np.int32), kv_indices=np.concatenate([lv[0].kv_indices] * 2))
    with pytest.raises(ValueError, match="a prefix longer than the request"):
        check_against_requests([long, lv[1]], *req, PS)
    partial = lv[0]._replace(kv_last_page_len=np.array([3], np.int32))
    with pytest.raises(ValueError, match="ends in a partial page"):
        check_against_requests([partial, lv[1]], *req, PS)
