"""The compiled page-key chain (``tierstore._c_chain``) against hashlib and the Python path.

The module is imported directly, so these run under ``TIERSTORE_PURE_PYTHON=1`` too (the
hasher's compiled path is switched on per test); they skip where the extension is not built.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore.hashing as hashing
from tierstore.errors import TokenError
from tierstore.hashing import PageHasher, as_tokens

try:
    _c: ModuleType = importlib.import_module("tierstore._c_chain")
except ImportError as exc:  # no compiler or no OpenSSL headers where it was installed
    pytest.skip(f"tierstore._c_chain is not built ({exc})", allow_module_level=True)


@pytest.fixture(scope="module")
def native() -> Iterator[ModuleType]:
    """The compiled path switched on in tierstore.hashing (even under TIERSTORE_PURE_PYTHON)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hashing, "_c", _c)
        yield _c


def _hashlib_chain(prev: bytes, packed: bytes, step: int, first: int, count: int) -> list[bytes]:
    keys, h = [], prev
    for i in range(first, first + count):
        h = hashlib.sha256(h + packed[i * step : (i + 1) * step]).digest()
        keys.append(h)
    return keys


@settings(max_examples=200, deadline=None)
@given(prev=st.binary(min_size=32, max_size=32),
       tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
       page=st.integers(1, 40), data=st.data())
def test_chain_equals_hashlib(prev: bytes, tokens: list[int], page: int,
                              data: st.DataObject) -> None:
    packed = np.array(tokens, "<u4").tobytes()
    step = page * 4
    pages = len(tokens) // page
    first = data.draw(st.integers(0, pages))
    count = data.draw(st.integers(0, pages - first))
    got = _c.chain(prev, packed, step, first, count)
    assert got == _hashlib_chain(prev, packed, step, first, count)
    assert all(type(k) is bytes for k in got)
    # any buffer works the same: the token array itself, a memoryview, a bytearray
    arr = np.frombuffer(packed, "<u4")
    assert _c.chain(bytearray(prev), arr, step, first, count) == got
    assert _c.chain(memoryview(prev), memoryview(packed), step, first, count) == got


@st.composite
def _prompt_runs(draw: st.DrawFn) -> tuple[int, list[tuple[str, list[int]]]]:
    """A page size and a run of prompts that share prefixes, extend and cut each other."""
    page = draw(st.integers(1, 8))
    bases = draw(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12 * page),
                          min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(1, 25))):
        base = draw(st.sampled_from(bases))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, 5), max_size=4 * page))
        prompts.append((draw(st.sampled_from(["a", "b"])), base[:cut] + tail))
    return page, prompts


@settings(max_examples=150, deadline=None)
@given(run=_prompt_runs(), memo_bytes=st.sampled_from([0, 64, 256, 4096, 16 << 20]))
def test_hasher_paths_agree_keys_and_memo(native: ModuleType,
                                          run: tuple[int, list[tuple[str, list[int]]]],
                                          memo_bytes: int) -> None:
    page, prompts = run
    fast = PageHasher("m", "l", page, memo_bytes=memo_bytes)
    slow = PageHasher("m", "l", page, memo_bytes=memo_bytes, native=False)
    fresh = PageHasher("m", "l", page, memo_bytes=0, native=False)
    # the memo alone: its record of the call before is forgotten before every call
    plain = PageHasher("m", "l", page, memo_bytes=memo_bytes, native=False)
    assert fast._c is native and slow._c is None
    for ns, prompt in prompts + prompts[-1:]:
        toks = as_tokens(np.array(prompt, np.int64))
        for _ in range(2):  # a match, then the insert of the same prompt
            got = fast.pages(toks, ns)
            plain._last = ("", b"", ())
            assert got == slow.pages(toks, ns) == fresh.pages(toks, ns) == plain.pages(toks, ns)
            got.clear()  # callers own their lists on both paths
            # the memo holds the same entries in the same (LRU) order
            for other in (slow, plain):
                assert list(fast._memo.items()) == list(other._memo.items())
                assert fast._memo_used == other._memo_used


@settings(max_examples=300, deadline=None)
@given(a=st.lists(st.integers(0, 3), max_size=40), b=st.lists(st.integers(0, 3), max_size=40),
       page=st.integers(1, 6), root=st.binary(min_size=32, max_size=32), remembered=st.booleans())
def test_extend_equals_its_twin(a: list[int], b: list[int], page: int, root: bytes,
                                remembered: bool) -> None:
    step = page * 4
    packed = np.array(a[: len(a) // page * page], "<u4").tobytes()
    seen_packed = np.array(b[: len(b) // page * page], "<u4").tobytes()
    twin = PageHasher("m", "l", page, native=False)
    seen = (seen_packed, tuple(_hashlib_chain(root, seen_packed, step, 0,
                                              len(seen_packed) // step))) if remembered else None
    try:
        want: object = twin._extend(root if seen is None or a[:page] != b[:page] else None,
                                    seen, packed, step)
    except AssertionError:
        want = ValueError
    try:
        got: object = _c.extend(root if seen is None or a[:page] != b[:page] else None, seen,
                                packed, step)
    except ValueError:
        got = ValueError
    assert got == want
    if isinstance(got, tuple):
        shared, keys = got
        assert keys == _hashlib_chain(root, packed, step, 0, len(packed) // step) \
            or shared  # (from seen's chain: the same keys wherever the pages are the same)
        if seen is not None:
            assert all(k is s for k, s in zip(keys[:shared], seen[1], strict=False))


def test_extend_rejects_bad_arguments() -> None:
    key, page = bytes(32), bytes(8)
    for args in ((None, None, page, 4), (bytes(31), None, page, 4), (key, None, page, 0),
                 (key, None, page, -1), (key, None, bytes(7), 4),
                 (None, (page, (key,)), b"x" * 8, 4),  # nothing shared, no root
                 (key, (bytes(4), (key, key)), page, 4),  # more keys than pages
                 (key, (page, (b"short", key)), page, 4)):
        with pytest.raises(ValueError):
            _c.extend(*args)
    wrong: list[tuple[object, ...]] = [
        (key, [page, (key,)], page, 4), (key, (page, [key]), page, 4), (key, (page,), page, 4),
        (key, None, "str", 4), (key, None, page, 4.0), (key, None, page)]
    for bad in wrong:
        with pytest.raises(TypeError):
            _c.extend(*bad)
    assert _c.extend(key, None, b"", 4) == (0, [])


def test_hasher_keeps_xxh3_and_opt_out_on_python(native: ModuleType) -> None:
    assert PageHasher("m", "l", 4, "xxh3")._c is None
    assert PageHasher("m", "l", 4, native=False)._c is None
    assert PageHasher("m", "l", 4)._c is native


_TOKEN_INPUTS = st.one_of(
    st.lists(st.integers(-3, 2**32 + 3), max_size=50),
    st.lists(st.integers(0, 2**32 - 1), max_size=50).map(tuple),
    st.lists(st.one_of(st.integers(0, 100), st.booleans(), st.floats(0, 10), st.text(max_size=1),
                       st.integers(0, 100).map(np.int64), st.just(2**64)), max_size=6),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20).map(lambda v: np.array(v, np.int64)),
    st.lists(st.integers(0, 2**32 + 5), max_size=40).map(lambda v: np.array(v, np.int64)),
    st.lists(st.integers(0, 2**32 + 5), max_size=40).map(lambda v: np.array(v, np.int64)[::2]),
)


@settings(max_examples=300, deadline=None)
@given(value=_TOKEN_INPUTS)
def test_as_tokens_paths_agree_on_values_and_errors(native: ModuleType, value: object) -> None:
    outcomes = []
    for path in (native, None):
        hashing._c = path
        try:
            arr = as_tokens(value)
        except TokenError as exc:
            outcomes.append(("error", str(exc)))
        else:
            assert arr.dtype == np.dtype("<u4") and arr.ndim == 1
            outcomes.append(("ok", arr.tolist()))
        finally:
            hashing._c = native
    assert outcomes[0] == outcomes[1]


def test_as_tokens_compiled_copies_are_fresh_and_writable(native: ModuleType) -> None:
    src = np.array([1, 2, 3], np.int64)
    for value in (src, [1, 2, 3], (1, 2, 3)):
        arr = as_tokens(value)
        assert arr.flags.writeable and arr.flags.owndata and arr.tolist() == [1, 2, 3]
    u4 = np.array([1, 2], "<u4")
    assert as_tokens(u4) is u4  # already packed: no copy, as before


@pytest.mark.parametrize("args", [
    (b"\0" * 31, b"\0" * 8, 4, 0, 1),      # prev not 32 bytes
    (b"\0" * 33, b"\0" * 8, 4, 0, 1),
    (b"\0" * 32, b"\0" * 8, 0, 0, 1),      # no step
    (b"\0" * 32, b"\0" * 8, -4, 0, 1),
    (b"\0" * 32, b"\0" * 8, 4, -1, 1),
    (b"\0" * 32, b"\0" * 8, 4, 0, -1),
    (b"\0" * 32, b"\0" * 8, 4, 2, 1),      # past the whole pages
    (b"\0" * 32, b"\0" * 9, 4, 1, 2),
    (b"\0" * 32, b"\0" * 8, 4, 3, 0),
    (b"\0" * 32, b"\0" * 8, 4, 2**62, 2**62),  # no overflow in the bound check
    (b"\0" * 32, b"\0" * 8, 4, 0, 2**70),   # beyond a Py_ssize_t
])
def test_chain_rejects_bad_lengths(args: tuple[object, ...]) -> None:
    with pytest.raises(ValueError):
        _c.chain(*args)


@pytest.mark.parametrize("args", [
    ("x" * 32, b"\0" * 8, 4, 0, 1),        # a str is not a buffer
    (b"\0" * 32, [0, 1], 4, 0, 1),
    (None, b"\0" * 8, 4, 0, 1),
    (b"\0" * 32, b"\0" * 8, 4.0, 0, 1),    # counts are ints
    (b"\0" * 32, b"\0" * 8, 4, "0", 1),
    (b"\0" * 32, b"\0" * 8, 4, 0),         # argument count
    (b"\0" * 32, b"\0" * 8, 4, 0, 1, 2),
])
def test_chain_rejects_bad_types(args: tuple[object, ...]) -> None:
    with pytest.raises(TypeError):
        _c.chain(*args)


def test_packers_reject_bad_arguments() -> None:
    out = np.empty(3, "<u4")
    with pytest.raises(TypeError):  # not int64 items
        _c.narrow_i64(np.zeros(3, np.float64), out)
    with pytest.raises(TypeError):
        _c.narrow_i64(np.zeros(3, np.int32), out)
    with pytest.raises(ValueError):  # not contiguous
        _c.narrow_i64(np.zeros(6, np.int64)[::2], out)
    with pytest.raises(ValueError):  # out: wrong length, wrong type, read-only
        _c.narrow_i64(np.zeros(4, np.int64), out)
    with pytest.raises(ValueError):
        _c.narrow_i64(np.zeros(3, np.int64), np.empty(3, "<i4"))
    with pytest.raises(ValueError):
        _c.narrow_i64(np.zeros(3, np.int64), np.frombuffer(bytes(12), "<u4"))
    with pytest.raises(TypeError):  # only lists and tuples
        _c.pack_ints(iter([1, 2, 3]), out)
    with pytest.raises(TypeError):
        _c.pack_ints(np.zeros(3, np.int64), out)
    with pytest.raises(ValueError):
        _c.pack_ints([1, 2], out)
    with pytest.raises(TypeError):
        _c.pack_ints([1, 2, 3])
    # out-of-range or non-int items are refused (False), not raised: the caller names them
    assert _c.pack_ints([1, True, 3], out) is False
    assert _c.pack_ints([1, -1, 3], out) is False
    assert _c.pack_ints([1, 2**32, 3], out) is False
    assert _c.pack_ints([1, 2**100, 3], out) is False
    assert _c.narrow_i64(np.array([1, -1, 3], np.int64), out) is False
    assert _c.narrow_i64(np.array([1, 2**32, 3], np.int64), out) is False
    assert _c.pack_ints((0, 2**32 - 1, 7), out) is True and out.tolist() == [0, 2**32 - 1, 7]


def test_pack_takes_only_flat_contiguous_uint32() -> None:
    arr = np.arange(10, dtype="<u4")
    assert _c.pack(arr, 6) == arr[:6].tobytes() and _c.pack(arr, 0) == b""
    for other in (arr[::2], arr.astype(">u4"), arr.astype(np.int64), arr.reshape(2, 5),
                  np.array(7, "<u4")):
        assert _c.pack(other, 1) is None  # the caller converts these
    with pytest.raises(ValueError):
        _c.pack(arr, 11)
    with pytest.raises(ValueError):
        _c.pack(arr, -1)
    with pytest.raises(TypeError):
        _c.pack([1, 2], 1)


_PROMPTS = st.one_of(
    st.lists(st.integers(-3, 2**32 + 3), max_size=60).map(lambda v: np.array(v, np.int64)),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20).map(lambda v: np.array(v, np.int64)),
    st.lists(st.integers(0, 2**32 - 1), max_size=60).map(lambda v: np.array(v, "<u4")),
    st.lists(st.integers(0, 2**32 + 3), max_size=60).map(lambda v: np.array(v, np.int64)[::3]),
    st.lists(st.integers(0, 2**32 - 1), max_size=60).map(lambda v: np.array(v, "<u4")[1::2]),
    st.lists(st.integers(0, 2**32 - 1), max_size=60).map(lambda v: np.array(v, "<u4")[::-1]),
    st.tuples(st.lists(st.integers(0, 100), max_size=20),
              st.sampled_from(["<i4", ">i8", ">u4", "<u8", "<f8", "<i2"])).map(
        lambda v: np.array(v[0], v[1])),
    st.lists(st.integers(0, 100), min_size=4, max_size=4).map(
        lambda v: np.array(v, np.int64).reshape(2, 2)),
    st.integers(0, 100).map(lambda v: np.array(v, np.int64)),
)


@settings(max_examples=400, deadline=None)
@given(value=_PROMPTS, page=st.integers(1, 20), limit=st.integers(0, 70))
def test_pack_prompt_equals_its_twin_and_the_checked_conversion(
        value: np.ndarray, page: int, limit: int) -> None:
    got = _c.pack_prompt(value, page, limit)
    assert got == hashing.pack_prompt(value, page, limit)
    try:
        toks = as_tokens(value)
    except TokenError:
        assert got is None  # what the checked path refuses, the shortcut leaves to it
        return
    if value.ndim != 1 or value.dtype not in (np.int64, np.dtype("<u4")) or len(toks) > limit:
        assert got is None
    else:
        assert got == toks[: len(toks) // page * page].tobytes()


def test_pack_prompt_rejects_bad_arguments() -> None:
    arr = np.arange(8, dtype=np.int64)
    for bad in ((arr, 0, 8), (arr, -1, 8), (arr, 4, -1), (arr, 2**70, 8)):
        with pytest.raises(ValueError):
            _c.pack_prompt(*bad)
    wrong: list[tuple[object, ...]] = [(arr, 4.0, 8), (arr, 4, "8"), (arr, 4), (arr, 4, 8, 1)]
    for args in wrong:
        with pytest.raises(TypeError):
            _c.pack_prompt(*args)
    for other in ("abcd", None, [1, 2, 3, 4], b"\0" * 8):  # not an id buffer: not its input
        assert _c.pack_prompt(other, 1, 8) is None


def test_buffers_are_released_on_every_path() -> None:
    """A bytearray cannot be resized while a buffer on it is held: after each call (returned or
    raised) every one must be resizable again."""
    prev, packed, out = bytearray(32), bytearray(16), bytearray(8)
    calls = [
        lambda: _c.chain(prev, packed, 4, 0, 4),
        lambda: _c.chain(prev, packed, 4, 0, 5),           # raises after taking both buffers
        lambda: _c.chain(bytearray(31), packed, 4, 0, 1),
        lambda: _c.chain(prev, "not a buffer", 4, 0, 1),   # raises after taking prev
        lambda: _c.narrow_i64(memoryview(packed).cast("q"), memoryview(out).cast("I")),
        lambda: _c.narrow_i64(memoryview(packed).cast("q"), memoryview(packed).cast("I")),
        lambda: _c.pack_ints([1, 2], memoryview(out).cast("I")),
        lambda: _c.pack_ints([1, 2, 3], memoryview(out).cast("I")),
        lambda: _c.pack(memoryview(packed).cast("I"), 4),
        lambda: _c.pack(memoryview(packed).cast("I"), 5),
        lambda: _c.pack(memoryview(packed).cast("i"), 1),
        lambda: _c.extend(bytes(32), None, packed, 4),
        lambda: _c.extend(bytes(32), None, packed, 3),                 # not whole pages
        lambda: _c.extend(None, (bytes(4), (bytes(32),) * 2), packed, 4),
        lambda: _c.pack_prompt(memoryview(packed).cast("q"), 1, 2),
        lambda: _c.pack_prompt(memoryview(packed).cast("q"), 1, 1),   # over the limit
        lambda: _c.pack_prompt(memoryview(packed).cast("I"), 3, 4),
        lambda: _c.pack_prompt(memoryview(packed).cast("i"), 1, 4),   # not its format
        lambda: _c.pack_prompt(memoryview(out).cast("q"), 1, 4),      # out of range
    ]
    for call in calls:
        with contextlib.suppress(TypeError, ValueError):
            call()
        for buf in (prev, packed, out):
            buf.append(0)  # BufferError if an export were still held
            del buf[-1]
