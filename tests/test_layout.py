import numpy as np
import pytest

from rtattn.plan.layout import (check_config, check_heads, dense_kv, indptr_from_lengths, paged_kv,
                                validate_batch)


def _ok():
    qo = np.array([0, 1, 3], np.int32)
    kvp = np.array([0, 2, 3], np.int32)
    idx = np.array([5, 1, 7], np.int32)
    last = np.array([3, 16], np.int32)
    return qo, kvp, idx, last


def test_valid_batch_lengths():
    b = validate_batch(*_ok(), 16, num_pages=8)
    assert b.batch == 2
    assert b.qo_len.tolist() == [1, 2]
    assert b.kv_len.tolist() == [16 + 3, 16]
    assert b.kv_len.dtype == np.int64   # int64 lengths: no wrap-around before the bounds checks


def test_python_lists_and_int64_accepted():
    qo, kvp, idx, last = _ok()
    b = validate_batch(qo.tolist(), kvp.astype(np.int64), list(idx), last, 16)
    assert b.qo_indptr.dtype == np.int32


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_non_integer_dtype_refused(which):
    args = list(_ok())
    name = ["qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"][which]
    args[which] = args[which].astype(np.float32)
    with pytest.raises(TypeError, match=name):
        validate_batch(*args, 16)


def test_non_monotone_indptr_names_index():
    qo, kvp, idx, last = _ok()
    kvp = np.array([0, 3, 2], np.int32)
    with pytest.raises(ValueError, match=r"kv_indptr is not monotone: kv_indptr\[2\]"):
        validate_batch(qo, kvp, idx, last, 16)


def test_indptr_must_start_at_zero():
    qo, kvp, idx, last = _ok()
    with pytest.raises(ValueError, match=r"qo_indptr\[0\] = 1"):
        validate_batch(qo + 1, kvp, idx, last, 16)


def test_wrong_lengths():
    qo, kvp, idx, last = _ok()
    with pytest.raises(ValueError, match="kv_indptr has 2 entries, expected 3"):
        validate_batch(qo, kvp[:2], idx, last, 16)
    with pytest.raises(ValueError, match="kv_last_page_len has 1 entries"):
        validate_batch(qo, kvp, idx, last[:1], 16)
    with pytest.raises(ValueError, match="kv_indices has 2 entries"):
        validate_batch(qo, kvp, idx[:2], last, 16)


def test_page_ids_out_of_pool():
    qo, kvp, idx, last = _ok()
    with pytest.raises(ValueError, match=r"kv_indices\[2\] = 7 is outside the page pool \[0, 7\)"):
        validate_batch(qo, kvp, idx, last, 16, num_pages=7)
    idx2 = idx.copy()
    idx2[1] = -1
    with pytest.raises(ValueError, match=r"kv_indices\[1\] = -1"):
        validate_batch(qo, kvp, idx2, last, 16)


def test_last_page_len_range():
    qo, kvp, idx, last = _ok()
    for bad in (0, 17):
        l2 = last.copy()
        l2[1] = bad
        with pytest.raises(ValueError, match=rf"kv_last_page_len\[1\] = {bad} outside \[1, "):
            validate_batch(qo, kvp, idx, l2, 16)


def test_empty_kv_request_allowed_and_last_ignored():
    qo = np.array([0, 1, 2], np.int32)
    kvp = np.array([0, 0, 1], np.int32)
    b = validate_batch(qo, kvp, np.array([0], np.int32), np.array([0, 4], np.int32), 16)
    assert b.kv_len.tolist() == [0, 4]


def test_causal_refuses_qo_longer_than_kv():
    qo = np.array([0, 5], np.int32)
    kvp = np.array([0, 1], np.int32)
    args = (qo, kvp, np.array([0], np.int32), np.array([3], np.int32), 16)
    validate_batch(*args)  # fine without causal
    with pytest.raises(ValueError, match="causal: request 0 has qo_len 5"):
        validate_batch(*args, causal=True)


def test_bounds_named():
    qo, kvp, idx, last = _ok()
    with pytest.raises(ValueError, match="batch 2 exceeds max_batch=1"):
        validate_batch(qo, kvp, idx, last, 16, max_batch=1)
    with pytest.raises(ValueError, match="exceed max_qo_tokens=2"):
        validate_batch(qo, kvp, idx, last, 16, max_qo_tokens=2)
    with pytest.raises(ValueError, match="exceed max_pages=2"):
        validate_batch(qo, kvp, idx, last, 16, max_pages=2)
    with pytest.raises(ValueError, match="max_qo_len=1"):
        validate_batch(qo, kvp, idx, last, 16, max_qo_len=1)


def test_heads_divide():
    assert check_heads(32, 8) == 4
    with pytest.raises(ValueError, match="num_qo_heads=32 is not a multiple of num_kv_heads=6"):
        check_heads(32, 6)


def test_builders():
    ip, idx, last = dense_kv([3, 0, 2])
    assert ip.tolist() == [0, 3, 3, 5] and idx.tolist() == list(range(5))
    assert last.tolist() == [1, 0, 1]
    ip, idx, last = paged_kv([17, 16, 1], 16, shuffle_seed=0)
    assert ip.tolist() == [0, 2, 3, 4] and sorted(idx.tolist()) == [0, 1, 2, 3]
    assert last.tolist() == [1, 16, 1]
    assert indptr_from_lengths([2, 0, 3]).tolist() == [0, 2, 2, 5]
    b = validate_batch(indptr_from_lengths([1, 1, 1]), ip, idx, last, 16)
    assert b.kv_len.tolist() == [17, 16, 1]


def test_indptr_differences_are_int64():
    """[0, 2**31-1, -2**31+1, 0] looks monotone when subtracted in int32 (the differences wrap)."""
    kvp = np.array([0, 2**31 - 1, -2**31 + 1, 0], np.int32)
    with pytest.raises(ValueError, match=r"kv_indptr is not monotone: kv_indptr\[2\]"):
        validate_batch(np.arange(4, dtype=np.int32), kvp, np.zeros(0, np.int32), np.ones(3, np.int32), 16)
    with pytest.raises(ValueError, match=r"qo_indptr is not monotone"):
        validate_batch(np.array([0, 2**31 - 1, -2**31 + 1], np.int32), np.zeros(3, np.int32),
                       np.zeros(0, np.int32), np.ones(2, np.int32), 16)


def test_kv_tokens_must_fit_int32():
    kvp = np.array([0, 2**27], np.int32)           # 2**27 pages x 16 = 2**31 tokens
    idx = np.zeros(2**27, np.int32)
    with pytest.raises(ValueError, match=r"KV tokens do not fit int32"):
        validate_batch(np.array([0, 1], np.int32), kvp, idx, np.array([16], np.int32), 16)


@pytest.mark.parametrize("args, kw, err, match", [
    ((32, 8, 128, 16), {}, None, None),
    ((32, 8, 0, 16), {}, ValueError, "head_dim must be >= 1, got 0"),
    ((32, 8, 100, 16), {}, ValueError, r"head_dim=100 is not supported; the kernels take \(64, 128, 256\)"),
    ((32, 8, 128.0, 16), {}, TypeError, "head_dim must be an int"),
    ((32, 8, 128, 3), {}, ValueError, "page_size=3: the kernels need a power of two"),
    ((32, 8, 128, 0), {}, ValueError, "page_size must be >= 1"),
    ((32, 8, 128, 16), dict(num_ctas=0), ValueError, "num_ctas must be >= 1, got 0"),
    ((32, 8, 128, 16), dict(num_ctas=True), TypeError, "num_ctas must be an int"),
    ((32, 0, 128, 16), {}, ValueError, "head counts must be positive"),
    (("32", 8, 128, 16), {}, TypeError, "num_qo_heads must be an int"),
])
def test_check_config(args, kw, err, match):
    if err is None:
        assert check_config(*args, **kw) == 4
        return
    with pytest.raises(err, match=match):
        check_config(*args, **kw)


def test_validate_batch_refuses_a_non_power_of_two_page():
    with pytest.raises(ValueError, match="power of two"):
        validate_batch(*_ok(), 12)


def test_negative_page_id_refused_under_a_pool_past_2_to_the_31():
    """The one-pass range check reads ids as unsigned: a pool of 2**31 pages or more must still
    refuse a negative id (-2**31 read as unsigned is 2**31, inside such a pool)."""
    qo, kvp, idx, last = _ok()
    idx = idx.copy()
    idx[1] = -2**31
    for pool in (2**31, 2**32):
        with pytest.raises(ValueError, match=r"kv_indices\[1\] = -2147483648 is negative"):
            validate_batch(qo, kvp, idx, last, 16, num_pages=pool)
