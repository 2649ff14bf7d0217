"""The match path's shortcuts (the hasher's one-call prompt check, the all-L1 hit in one pass)
give what the step-by-step path gives, and bad input still raises the same named errors and
changes nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tierstore import rule
from tierstore.errors import NamespaceError, TokenError
from tierstore.hashing import PageHasher, check_namespace
from tierstore.results import MatchResult
from tierstore.store import TierStore

from .conftest import FULL_ONLY, HYBRID, PAGE, SWA_ONLY, store


def _run(config: dict, host: int, seed: int, **kwargs: object
         ) -> tuple[list[tuple[object, ...]], object]:
    """A random engine loop (shared prefixes, evictions, L2 hits where there is an L2): every
    match's result and the final stats."""
    rng = random.Random(seed)
    s = store(config, capacity=48 << 10, host_capacity_bytes=host, **kwargs)
    prefixes = [[rng.randrange(50) for _ in range(PAGE * rng.randrange(1, 5))] for _ in range(4)]
    out: list[tuple[object, ...]] = []
    for _ in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(12))]
        form = rng.choice(["np", "list", "u4"])
        value = np.array(prompt, np.int64) if form == "np" else \
            np.array(prompt, "<u4") if form == "u4" else prompt
        ns = rng.choice(["default", "t|a"])
        m = s.match(value, ns)
        out.append(_fields(m))
        n = len(prompt) // PAGE
        demand = {"kv": n - m.pages}
        if "swa" in s.kinds:
            demand["swa"] = n - m.pages
        if "state" in s.kinds and n and len(prompt) % PAGE == 0:
            demand["state"] = 1
        got = s.allocate(demand)
        if got is not None:
            s.insert(value, ns, kv=got["kv"], swa=got.blocks.get("swa"),
                     state=got.blocks.get("state"))
        if m.lease is not None:
            s.release(m.lease)
        s.check_integrity()
    return out, s.stats()


def _fields(m: MatchResult) -> tuple[object, ...]:
    return (m.tokens, m.pages, m.kv.tolist(), m.swa.tolist(), m.state, m.lease is None,
            m.kv_pages_found, m.tiers, m.lost, m.evicted_from)


@pytest.mark.parametrize("config", [HYBRID, SWA_ONLY, FULL_ONLY])
@pytest.mark.parametrize(("host", "policy"), [(0, "write_back"), (64 << 10, "write_back"),
                                              (64 << 10, "write_through_selective")])
def test_shortcuts_give_the_step_by_step_results(config: dict, host: int, policy: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in range(3):
        fast = _run(config, host, seed, write_policy=policy)
        with monkeypatch.context() as mp:
            mp.setattr(rule, "held_in_l1", lambda *a, **k: None)
            mp.setattr(PageHasher, "prompt", lambda *a, **k: None)
            slow = _run(config, host, seed, write_policy=policy)
        assert fast == slow
        assert any(r[1] for r in fast[0])  # some matches hit


@pytest.mark.parametrize(("tokens", "ns", "error"), [
    ([1, "x", 3, 4], "default", TokenError),
    (np.array([1, -1, 3, 4], np.int64), "default", TokenError),
    (np.array([1, 2**32, 3, 4, 5], np.int64), "default", TokenError),  # (in the partial page)
    (np.array([1, 2, 2**32, 3], np.int64)[::2], "default", TokenError),
    (np.zeros((2, 4), np.int64), "default", TokenError),
    (np.zeros(8, np.float64), "default", TokenError),
    (np.zeros(65, np.int64), "default", TokenError),  # over max_tokens
    (np.zeros(65, "<u4"), "default", TokenError),
    (np.zeros(8, np.int64), "bad ns", NamespaceError),
    (np.zeros(8, np.int64), 7, NamespaceError),
    (np.zeros(8, np.int64), "bad tenant|a", NamespaceError),
    (np.zeros(8, np.int64), None, NamespaceError),
    (np.array([1, -1], np.int64), "bad ns", TokenError),  # tokens are checked first
])
def test_bad_input_to_match_raises_and_changes_nothing(tokens: object, ns: object,
                                                       error: type[Exception]) -> None:
    s = store(max_tokens=64)
    good = np.arange(8, dtype=np.int64)
    for _ in range(2):  # the namespace and the prompt are known: the shortcuts are warm
        alloc = s.allocate({"kv": 2, "swa": 2, "state": 1})
        assert alloc is not None
        s.insert(good, kv=alloc["kv"], swa=alloc["swa"], state=alloc["state"])
        m = s.match(good)
        assert m.pages == 2 and m.lease is not None
        s.release(m.lease)
    before = (s.stats(), s.index.num_pages, {k: s.arena.num_live(k) for k in s.kinds})
    with pytest.raises(error):
        s.match(tokens, ns)
    with pytest.raises(error):
        s.peek(tokens, ns)
    after = (s.stats(), s.index.num_pages, {k: s.arena.num_live(k) for k in s.kinds})
    assert before == after
    s.check_integrity()


class _OddStr(str):
    """A str whose equality and hash are its own: never taken as a checked namespace."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("default")


def test_the_namespace_memo_checks_what_it_did_before() -> None:
    assert check_namespace("t|memo-a") == "t|memo-a"
    assert check_namespace("t|memo-a") == "t|memo-a"  # remembered
    with pytest.raises(NamespaceError):  # the service's unscoped check still refuses it
        check_namespace("t|memo-a", scoped=False)
    check_namespace("default")
    with pytest.raises(NamespaceError):
        check_namespace(_OddStr("bad ns"))
    with pytest.raises(NamespaceError):
        check_namespace(["default"])
    h = PageHasher("m", "l", PAGE)
    h.pages(np.arange(8, dtype="<u4"), "default")
    assert h.prompt(np.arange(8), _OddStr("bad ns"), 64) is None
    assert h.prompt(np.arange(8), "never-used", 64) is None  # checked the long way first
    assert h.prompt(np.arange(8), "default", 64) == (8, h.pages(np.arange(8, dtype="<u4"),
                                                                "default"))


@pytest.mark.parametrize("value", [
    np.arange(10, dtype=np.int64), np.arange(10, dtype="<u4"), np.arange(20, dtype=np.int64)[::2],
    np.arange(3, dtype=np.int64), np.zeros(0, np.int64),
])
def test_prompt_counts_and_keys_equal_the_checked_path(value: np.ndarray) -> None:
    a, b = PageHasher("m", "l", PAGE), PageHasher("m", "l", PAGE)
    for h in (a, b):
        h.root("default")
    got = a.prompt(value, "default", 64)
    assert got is not None
    toks = np.asarray(value).astype("<u4")
    assert got == (len(toks), b.pages(toks, "default"))
    assert list(a._memo.items()) == list(b._memo.items()) and a._last == b._last
    for bad in (torch.arange(10), list(range(10)), np.arange(10, dtype=np.int32)):
        assert a.prompt(bad, "default", 64) is None  # other forms: the checked path
    assert a.prompt(value, "default", len(value) - 1) is None if len(value) else True


def test_store_match_on_tensors_and_lists_still_works() -> None:
    s: TierStore = store()
    alloc = s.allocate({"kv": 2, "swa": 2, "state": 1})
    assert alloc is not None
    s.insert(list(range(8)), kv=alloc["kv"], swa=alloc["swa"], state=alloc["state"])
    for value in (torch.arange(8), list(range(8)), tuple(range(8)),
                  np.arange(8, dtype="<u4").tobytes()):
        m = s.match(value)
        assert m.pages == 2 and m.lease is not None
        s.release(m.lease)
