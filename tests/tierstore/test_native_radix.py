"""``tierstore._c_radix`` (held, walk) against its pure twins (``rule._held``,
``RadixIndex._walk``) on random trees, and its refusals of malformed input."""

from __future__ import annotations

import random
import sys
from typing import ClassVar

import numpy as np
import pytest

from tierstore import rule
from tierstore.config import StoreConfig
from tierstore.layout import load_preset
from tierstore.radix import ABSENT, Node, RadixIndex, Segment, Tier
from tierstore.store import TierStore

c = pytest.importorskip("tierstore._c_radix") if rule._c is not None else None
pytestmark = pytest.mark.skipif(c is None, reason="tierstore._c_radix not in use")


def _store(seed: int) -> tuple[TierStore, list[np.ndarray]]:
    """A small hybrid (gpt-oss) store after random inserts, evictions and tombstones, and the
    prompts it saw."""
    rng = random.Random(seed)
    layout = load_preset("gpt-oss-20b", page_size=4)
    unit = sum(e.nbytes for e in layout.envelopes().values())
    store = TierStore(layout, StoreConfig(capacity_bytes=(60 * unit + 15) // 16 * 16,
                                          device="meta", attribution=False, mrc=False))
    prefixes = [np.array([rng.randrange(1000) for _ in range(4 * rng.randint(1, 4))])
                for _ in range(3)]
    prompts = []
    for _ in range(60):
        tail = np.array([rng.randrange(1000) for _ in range(4 * rng.randint(0, 6) + 2)])
        prompt = np.concatenate([rng.choice(prefixes), tail]).astype(np.int64)
        prompts.append(prompt)
        m = store.match(prompt)
        n = len(prompt) // 4 - m.pages
        got = store.allocate({"kv": n, "swa": n}) if n else None
        if got is not None:
            store.insert(prompt, kv=got["kv"], swa=got["swa"])
        if m.lease is not None:
            store.release(m.lease)
        if rng.random() < 0.3:  # an SWA tombstone or a missing KV page somewhere
            nodes = list(store.index.nodes())
            node = rng.choice(nodes)
            kind = rng.choice(("kv", "swa"))
            j = rng.randrange(len(node.keys))
            old = node.ids(1, kind)[j]
            if old >= 0 and node.lock == 0:
                store.index.set(node, Tier.L1, kind, j, ABSENT)
                store.arena.free_owned(kind, [old])
    store.check_integrity()
    return store, prompts


def _shape(path: list[Segment]) -> list[tuple[int, int]]:
    return [(id(s.node), s.pages) for s in path]


@pytest.mark.parametrize("seed", range(8))
def test_walk_and_held_match_their_twins(seed: int) -> None:
    """On every prompt the store saw, prefixes of it and strangers, the compiled walk gives the
    same segments (type, node, pages) as the Python one, and the compiled held the same answer
    as rule._held for every window, with and without the SWA check."""
    store, prompts = _store(seed)
    rng = random.Random(seed)
    index = store.index
    seen_none = seen_held = 0
    for prompt in prompts:
        keys = store.hasher.pages(prompt.astype(np.uint32), "default")
        for cut in {len(keys), len(keys) // 2, max(0, len(keys) - 1), 0}:
            k = keys[:cut]
            if rng.random() < 0.2 and k:
                k = [*k[:-1], b"\x00" * 32]  # parts inside a node or at a child
            fast, slow = index.walk(k), index._walk(k)
            assert all(type(s) is Segment for s in fast)
            assert _shape(fast) == _shape(slow)
            for swa in (False, True):
                for window in (0, 1, 3, 1000):
                    got = c.held(fast, window if swa else -1)
                    want = rule._held(slow, swa=swa, window=window) if slow else None
                    if want is None:
                        assert got is None
                        seen_none += 1
                        continue
                    seen_held += 1
                    assert got is not None and got[0] == want[0]
                    assert isinstance(got[1], bytearray) and isinstance(got[2], bytearray)
                    assert np.frombuffer(got[1], np.int64).tolist() == want[1].tolist()
                    assert np.frombuffer(got[2], np.int64).tolist() == want[2].tolist()
    assert seen_none and seen_held


def _node(children: dict[bytes, Node] | None = None, keys: list[bytes] | None = None) -> Node:
    n = Node(None, 0, keys if keys is not None else [b"a", b"b"])
    if children:
        n.children.update(children)
    return n


def test_held_refuses_malformed_paths() -> None:
    """Bad arguments raise (TypeError, ValueError, OverflowError, KeyError) and change nothing."""
    node = _node()
    node._pages[0] = {"kv": [1, 2], "swa": [3, 4]}
    good = [Segment(node, 2)]
    assert c.held(good, -1) is not None
    assert c.held([], 3) is None
    with pytest.raises(TypeError):
        c.held(tuple(good), -1)
    with pytest.raises(TypeError):
        c.held(good)
    with pytest.raises(TypeError):
        c.held(good, "3")
    with pytest.raises(AttributeError):
        c.held([object()], -1)
    bad = Segment(node, -1)
    with pytest.raises(ValueError):
        c.held([bad], -1)
    assert c.held([Segment(node, 5)], -1) == (2, bytearray(np.array([1, 2]).tobytes()),
                                              bytearray(np.array([3, 4]).tobytes()))
    for cols, error in (({"kv": [1, "x"], "swa": [3, 4]}, TypeError),
                        ({"kv": [1, 2**70], "swa": [3, 4]}, OverflowError),
                        ({"kv": {1, 2}, "swa": [3, 4]}, TypeError),
                        ({"swa": [3, 4]}, KeyError), ({"kv": [1, 2]}, KeyError)):
        node._pages[0] = cols  # type: ignore[assignment]
        with pytest.raises(error):
            c.held(good, -1)
    node._pages = {"kv": [1]}  # type: ignore[assignment]
    with pytest.raises(TypeError):
        c.held(good, -1)
    node._pages = [[1, 2]]  # type: ignore[list-item]
    with pytest.raises(TypeError):
        c.held(good, -1)


class _Key(bytes):
    """A key whose comparison runs Python code: raises, or empties the keys being walked."""

    victim: ClassVar[list[bytes]] = []
    raises: ClassVar[bool] = False

    def __eq__(self, other: object) -> bool:
        if _Key.raises:
            raise RuntimeError("eq")
        _Key.victim.clear()
        return False

    __hash__ = bytes.__hash__


def test_walk_refuses_malformed_trees() -> None:
    """Bad arguments raise and change nothing; comparisons that run Python code (raising, or
    emptying the keys list mid-walk) are survived."""
    index = RadixIndex(lambda n: (0.0,))
    leaf = _node(keys=[b"k1", b"k2", b"k3"])
    index.root.children[b"k1"] = leaf
    keys = [b"k1", b"k2", b"zz"]
    assert _shape(c.walk(index.root, keys, Segment)) == [(id(leaf), 2)]
    assert c.walk(index.root, [], Segment) == []
    with pytest.raises(TypeError):
        c.walk(index.root, tuple(keys), Segment)
    with pytest.raises(TypeError):
        c.walk(index.root, keys, "Segment")
    with pytest.raises(TypeError):
        c.walk(index.root, keys)
    with pytest.raises(AttributeError):
        c.walk(object(), keys, Segment)
    with pytest.raises(AttributeError):  # a type whose instances have no such slots
        c.walk(index.root, keys, int)
    odd = _node()
    odd.children = [1]  # type: ignore[assignment]
    with pytest.raises(TypeError):
        c.walk(odd, keys, Segment)
    leaf.keys = (b"k1", b"k2")  # type: ignore[assignment]
    with pytest.raises(TypeError):
        c.walk(index.root, keys, Segment)
    # comparisons running Python code
    walked = [b"k1", _Key(b"k2"), b"k3"]
    leaf.keys = [b"k1", b"k2", b"k3"]
    _Key.victim = walked
    assert _shape(c.walk(index.root, walked, Segment)) == [(id(leaf), 1)]
    _Key.raises = True
    try:
        with pytest.raises(RuntimeError):
            c.walk(index.root, [b"k1", _Key(b"k2")], Segment)
    finally:
        _Key.raises = False


def test_no_references_leak() -> None:
    """Repeated calls, failing ones included, leave every object's reference count as found."""
    store, prompts = _store(3)
    keys = store.hasher.pages(prompts[-1].astype(np.uint32), "default")
    path = store.index.walk(keys)
    node = path[0].node if path else store.index.root
    before = (sys.getrefcount(node), sys.getrefcount(keys), sys.getrefcount(Segment),
              [sys.getrefcount(k) for k in keys])
    for _ in range(2000):
        c.walk(store.index.root, keys, Segment)
        c.held(path, 3)
        c.held(path, -1)
        with pytest.raises(TypeError):
            c.walk(store.index.root, keys, 5)
    after = (sys.getrefcount(node), sys.getrefcount(keys), sys.getrefcount(Segment),
             [sys.getrefcount(k) for k in keys])
    assert before == after
