"""Levels from plain page tables: the LCP of neighbours, the prefix tree, the levels."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rtattn.plan.levels import check_against_requests, union_batch
from rtattn.plan.prefix_tree import adjacent_lcp, prefix_order, share_prefixes

from cascade_cases import one_prefix_batch, shared_batch


def _brute_lcp(kv_indptr, kv_indices):
    out = []
    for i in range(len(kv_indptr) - 2):
        a = kv_indices[kv_indptr[i]:max(kv_indptr[i + 1] - 1, kv_indptr[i])]
        b = kv_indices[kv_indptr[i + 1]:max(kv_indptr[i + 2] - 1, kv_indptr[i + 1])]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        out.append(n)
    return np.array(out, np.int64)


@given(st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=7), min_size=1, max_size=9))
@settings(max_examples=150, deadline=None)
def test_adjacent_lcp_matches_brute_force(lists):
    kv_indptr = np.zeros(len(lists) + 1, np.int32)
    kv_indptr[1:] = np.cumsum([len(x) for x in lists])
    kv_indices = np.array([p for x in lists for p in x], np.int32)
    assert adjacent_lcp(kv_indptr, kv_indices).tolist() == _brute_lcp(kv_indptr, kv_indices).tolist()


def test_equal_page_counts_take_the_shift_path_and_agree():
    kv_indptr, idx, last, _ = one_prefix_batch(6, 100, 40, 16)
    idx = idx.copy()
    idx[kv_indptr[3] + 2] = 999      # request 3 leaves the prefix at page 2
    assert adjacent_lcp(kv_indptr, idx).tolist() == _brute_lcp(kv_indptr, idx).tolist() == [7, 7, 2, 2, 7]


def test_one_shared_prefix_gives_two_levels():
    kv_indptr, idx, last, _ = one_prefix_batch(4, 8192, 128, 16)
    lv = share_prefixes(kv_indptr, idx, last, 16)
    assert len(lv) == 2
    assert lv[0].qo_indptr.tolist() == [0, 4] and lv[0].kv_indptr.tolist() == [0, 512]
    assert np.array_equal(lv[0].kv_indices, idx[:512]) and lv[0].kv_last_page_len.tolist() == [16]
    assert lv[1].kv_indptr.tolist() == [0, 8, 16, 24, 32]
    check_against_requests(lv, kv_indptr, idx, last, 16)


def test_a_tree_of_prefixes_nests_into_levels():
    rng = np.random.default_rng(3)
    kv_indptr, idx, last, _ = shared_batch(rng, 4, groups=((3, 2), (2, 1)), loners=1)
    lv = share_prefixes(kv_indptr, idx, last, 4, max_levels=3)
    assert [l.qo_indptr.tolist() for l in lv[:2]] == [[0, 5, 6], [0, 3, 5, 6]]
    assert np.diff(lv[0].kv_indptr).tolist() == [2, 0] and np.diff(lv[1].kv_indptr).tolist() == [2, 1, 0]
    check_against_requests(lv, kv_indptr, idx, last, 4)
    union_batch(lv, 4)   # positions nest
    two = share_prefixes(kv_indptr, idx, last, 4, max_levels=2)   # the groups' pages stay in the suffixes
    assert len(two) == 2 and np.diff(two[0].kv_indptr).tolist() == [2, 0]
    check_against_requests(two, kv_indptr, idx, last, 4)


def test_last_pages_and_non_neighbours_are_not_shared():
    # request 0 is exactly request 1's first page; 0 and 2 share a prefix but 1 sits between them
    kv_indptr = np.array([0, 1, 3, 5], np.int32)
    idx = np.array([7, 7, 8, 9, 5], np.int32)
    assert adjacent_lcp(kv_indptr, idx).tolist() == [0, 0]
    assert len(share_prefixes(kv_indptr, idx, np.array([4, 4, 4], np.int32), 4)) == 1
    order = prefix_order(np.array([0, 2, 3, 5], np.int32), np.array([9, 1, 5, 9, 2], np.int32))
    assert order.tolist() == [1, 0, 2]


def test_append_queries_follow_their_requests():
    kv_indptr, idx, last, _ = one_prefix_batch(3, 64, 30, 16)
    qo = np.array([0, 2, 5, 6], np.int32)
    lv = share_prefixes(kv_indptr, idx, last, 16, qo)
    assert lv[0].qo_indptr.tolist() == [0, 6] and lv[1].qo_indptr.tolist() == qo.tolist()


def test_bad_arguments():
    with pytest.raises(ValueError, match="qo_indptr has 3 entries"):
        share_prefixes([0, 1], [0], [1], 4, [0, 1, 2])
    with pytest.raises(ValueError, match="max_levels"):
        share_prefixes([0, 1], [0], [1], 4, max_levels=0)
