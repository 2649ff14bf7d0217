from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from tierstore.errors import NamespaceError, TokenError
from tierstore.hashing import PageHasher, as_tokens


def test_keys_are_chained_sha256_over_packed_uint32_pages() -> None:
    h = PageHasher("model", "layout", page_size=2)
    keys = h.pages(as_tokens([1, 2, 3, 4, 5]), "tenant-a")
    assert len(keys) == 2  # the partial third page has no key
    salt = hashlib.sha256(b"tierstore/v1|model|layout|tenant-a").digest()
    h1 = hashlib.sha256(salt + np.array([1, 2], "<u4").tobytes()).digest()
    h2 = hashlib.sha256(h1 + np.array([3, 4], "<u4").tobytes()).digest()
    assert keys == [h1, h2]


def test_namespaces_models_and_layouts_never_share_a_key() -> None:
    toks = as_tokens(list(range(8)))
    base = PageHasher("m", "l", 4).pages(toks, "a")
    assert not set(base) & set(PageHasher("m", "l", 4).pages(toks, "b"))
    assert not set(base) & set(PageHasher("m2", "l", 4).pages(toks, "a"))
    assert not set(base) & set(PageHasher("m", "l2", 4).pages(toks, "a"))


def test_xxh3_is_selectable_and_differs() -> None:
    toks = as_tokens(list(range(8)))
    a = PageHasher("m", "l", 4, "xxh3").pages(toks, "a")
    assert len(a) == 2 and all(len(k) == 16 for k in a)
    assert a != PageHasher("m", "l", 4).pages(toks, "a")
    with pytest.raises(ValueError):
        PageHasher("m", "l", 4, "md5")  # type: ignore[arg-type]


def test_token_inputs_agree_and_bad_ones_are_named() -> None:
    ref = as_tokens([1, 2, 70000])
    for form in (np.array([1, 2, 70000], np.int64), torch.tensor([1, 2, 70000]),
                 np.array([1, 2, 70000], "<u4").tobytes()):
        assert np.array_equal(as_tokens(form), ref)
    for bad in ([1, "2"], [1.5], [-1], [2**32], "abc", b"\x00\x01\x02", [[1, 2]], [True]):
        with pytest.raises(TokenError):
            as_tokens(bad)


@pytest.mark.parametrize("dtype", ["<i8", ">i8", "<u8", ">u8", "<i4", ">i4", "<i2", "<u2"])
def test_token_range_is_checked_in_every_integer_dtype(dtype: str) -> None:
    info = np.iinfo(np.dtype(dtype))
    ok = np.array([0, 7, min(info.max, 2**32 - 1)], dtype=dtype)
    assert as_tokens(ok).tolist() == [0, 7, min(info.max, 2**32 - 1)]
    for bad in (-1, 2**32, info.min, info.max):
        if 0 <= bad < 2**32 or not info.min <= bad <= info.max:
            continue
        with pytest.raises(TokenError):
            as_tokens(np.array([5, bad, 6], dtype=dtype))
        with pytest.raises(TokenError):  # strided views are checked too
            as_tokens(np.array([5, 1, bad, 2], dtype=dtype)[::2])


@pytest.mark.parametrize("ns", ["", "-lead", "a b", "x" * 129, 7, None])
def test_bad_namespaces_raise(ns: object) -> None:
    with pytest.raises(NamespaceError):
        PageHasher("m", "l", 4).root(ns)  # type: ignore[arg-type]


def test_remembered_keys_equal_fresh_ones_and_callers_own_their_lists() -> None:
    memo = PageHasher("m", "l", 4)
    fresh = PageHasher("m", "l", 4, memo_bytes=0)
    base = list(range(40))
    prompts = [base, base + [7] * 8, base[:20], base[:24] + [9] * 16, base[:3],
               [5] + base[1:40]]
    for ns in ("tenant-a", "tenant-b"):
        for p in prompts + prompts[::-1]:
            got = memo.pages(as_tokens(p), ns)
            assert got == fresh.pages(as_tokens(p), ns)
            got.clear()  # a caller changing its list must not change what is remembered
    assert memo.pages(as_tokens(base), "tenant-a") == fresh.pages(as_tokens(base), "tenant-a")
