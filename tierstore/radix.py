"""Radix prefix index at page granularity, with typed per-tier residency.

A node owns a run of pages (chained page keys) and, per tier and kind, where each page's
envelope lives: L1 and L2 virtual ids, disk slot numbers, and for L3 a presence flag (the
Redis key derives from the page key); ``ABSENT`` (-1) where a tier does not hold it. An
absent ``swa`` page beside a present ``kv`` page is a *tombstone*. A recurrent-state
checkpoint exists only at a node's end, again per tier. Locks propagate to the root, so a
locked node's ancestors are locked too.

Every residency change goes through the index (:meth:`RadixIndex.set`,
:meth:`RadixIndex.clear`), which keeps per-node counts (entries held per tier, children
holding something per tier) and, per tier, the queue of eviction candidates: unlocked nodes
that hold something in the tier while none of their children do. So "does this node hold
anything in tier t" is O(1) and the next victim is O(log n). The index records; the store
decides and frees.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum

from tierstore.eviction import EvictionQueue
from tierstore.native import load

# walk (tierstore/_c_radix.c), or None: RadixIndex.walk's Python loop
_c = load("tierstore._c_radix")
_serial = itertools.count()

ABSENT = -1
PAGE_KINDS = ("kv", "swa")
CHECKPOINT = "state"


class Tier(IntEnum):
    """Where an entry lives: the device arena, the host arena, Redis, the local disk (its
    number is not its place in the chain: see ``CHAIN``)."""

    L1 = 1
    L2 = 2
    L3 = 3
    DISK = 4


TIERS = (Tier.L1, Tier.L2, Tier.L3, Tier.DISK)
_TIER_AT = tuple(range(len(TIERS)))  # tier - 1 of each
CHAIN = (Tier.L1, Tier.L2, Tier.DISK, Tier.L3)  # nearest first: demotion walks down it
TIER_NAMES: dict[int, str] = {Tier.L1: "l1", Tier.L2: "l2", Tier.L3: "l3", Tier.DISK: "disk"}
Key = Callable[["Node"], tuple[float, ...]]


class _Absent(dict[str, Sequence[int]]):
    """A tier's page columns holding nothing, shared by every node of one length (read only:
    a node gets private lists on its first write to the tier). Most nodes never hold anything
    in most tiers, and a new leaf's L1 columns arrive whole: allocating ABSENT lists per node
    and tier cost more than the rest of building one."""


_ABSENT_COLUMNS: dict[int, _Absent] = {}


def _absent(n: int) -> _Absent:
    """The shared empty columns of an ``n``-page node."""
    cols = _ABSENT_COLUMNS.get(n)
    if cols is None:
        row = (ABSENT,) * n
        cols = _Absent(kv=row, swa=row)
        if len(_ABSENT_COLUMNS) < 4096:
            _ABSENT_COLUMNS[n] = cols
    return cols


def _own(node: Node, t: int) -> dict[str, list[int]]:
    """Tier ``t``'s columns of ``node``, made private and writable (copied from the shared
    empty ones on the first write)."""
    cols = node._pages[t]
    if type(cols) is _Absent:
        cols = node._pages[t] = {k: list(v) for k, v in cols.items()}
    return cols  # type: ignore[return-value]


class Node:
    """A run of pages; ``depth`` counts the pages above it (its first page's position).

    Residency is read with :meth:`ids` / :meth:`checkpoint` / :meth:`holds` and changed only
    through the index."""

    __slots__ = ("_child_held", "_held", "_pages", "_state", "children", "depth", "hits",
                 "keys", "last_use", "lock", "parent", "priority", "queued", "serial",
                 "used_at")

    def __init__(self, parent: Node | None, depth: int, keys: list[bytes] | None = None) -> None:
        self.parent = parent
        self.depth = depth
        self.keys: list[bytes] = keys if keys is not None else []
        # [tier - 1][kind] -> per-page entries (shared read-only ABSENT rows until the first
        # write to the tier: see _own); [tier - 1] -> checkpoint entry (one per tier)
        none = _absent(len(self.keys))
        self._pages: list[dict[str, Sequence[int]]] = [none, none, none, none]
        self._state = [ABSENT, ABSENT, ABSENT, ABSENT]
        self._held = [0, 0, 0, 0]  # entries >= 0 per tier
        self._child_held = [0, 0, 0, 0]  # children holding anything, per tier
        self.queued = [0, 0, 0, 0]  # the eviction queue's stamp per tier (0: not queued)
        self.children: dict[bytes, Node] = {}
        self.lock = 0
        self.last_use = 0.0  # logical clock: orders LRU deterministically
        self.used_at = 0.0  # wall clock (time.monotonic), for idle demotion
        self.hits = 0
        self.priority = 0
        self.serial = next(_serial)  # creation order: ties broken

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, pages={len(self.keys)}, held={self._held})"

    @property
    def end(self) -> int:
        """Position (in pages) just past this node's last page."""
        return self.depth + len(self.keys)

    def is_leaf(self) -> bool:
        return not self.children and self.parent is not None

    def ids(self, tier: int, kind: str) -> Sequence[int]:
        """Per-page entries of ``kind`` ("kv" / "swa") in ``tier`` (read only)."""
        return self._pages[tier - 1][kind]

    def checkpoint(self, tier: int) -> int:
        """The checkpoint entry at this node's end in ``tier`` (ABSENT: none)."""
        return self._state[tier - 1]

    def entry(self, tier: int, kind: str, j: int) -> int:
        """Page ``j``'s entry of ``kind``, or the checkpoint when ``kind`` is "state"."""
        return self._state[tier - 1] if kind == CHECKPOINT else self._pages[tier - 1][kind][j]

    def holds(self, tier: int) -> bool:
        """Whether anything of this node lives in ``tier``. O(1)."""
        return self._held[tier - 1] > 0

    def holds_any(self) -> bool:
        return any(self._held)

    def evictable(self, tier: int) -> bool:
        """An eviction candidate of ``tier``: unlocked, holds something there, and no child
        does (the tier's leaves)."""
        t = tier - 1
        return (self.lock == 0 and self.parent is not None and self._held[t] > 0
                and self._child_held[t] == 0)


class Segment:
    """``pages`` pages matched at the start of ``node``."""

    __slots__ = ("node", "pages")

    def __init__(self, node: Node, pages: int) -> None:
        self.node = node
        self.pages = pages

    def __repr__(self) -> str:
        return f"Segment({self.node!r}, {self.pages})"


class RadixIndex:
    """The tree. Every mutation keeps :func:`tierstore.integrity.check_index` true; ``key``
    orders eviction candidates (the policy's key: the smallest goes first)."""

    def __init__(self, key: Key) -> None:
        self.root = Node(parent=None, depth=0)
        self.num_nodes = 0
        self.num_pages = 0
        self.key = key
        self.queues = {t: EvictionQueue(t, key) for t in TIERS}
        self._queue_at = [self.queues[t] for t in TIERS]  # by tier - 1: the hot paths' lookup

    # ------------------------------------------------------------------ lookup
    def walk(self, keys: Sequence[bytes]) -> list[Segment]:
        """The longest run of ``keys`` present in the tree, as segments along one path.
        Changes nothing."""
        if _c is not None and type(keys) is list:
            return _c.walk(self.root, keys, Segment)
        return self._walk(keys)

    def _walk(self, keys: Sequence[bytes]) -> list[Segment]:
        """:meth:`walk` in Python (``_c_radix.walk``'s twin)."""
        path: list[Segment] = []
        node, pos, total = self.root, 0, len(keys)
        while pos < total:
            child = node.children.get(keys[pos])
            if child is None:
                break
            ck = child.keys
            m = len(ck)
            if m == 1 or keys[pos:pos + m] == ck:  # the whole node (the usual case), in C
                n = m
            else:  # the keys stop or part inside it: find where
                limit = min(m, total - pos)
                n = 1
                while n < limit and ck[n] == keys[pos + n]:
                    n += 1
            path.append(Segment(child, n))
            pos += n
            if n < m:
                break
            node = child
        return path

    def next_victim(self, tier: int) -> Node | None:
        """The eviction candidate of ``tier`` that the policy evicts first, or None. Changes
        nothing: the caller evicts it (which takes it off the queue) before asking again."""
        return self._queue_at[tier - 1].peek()  # (Tier(tier) costs ~2 us, as much as the peek)

    # ---------------------------------------------------------------- residency
    def set(self, node: Node, tier: int, kind: str, j: int, value: int) -> None:
        """Record page ``j``'s entry of ``kind`` in ``tier`` (the checkpoint when ``kind`` is
        "state"; ``j`` is then ignored); ABSENT removes it."""
        t = tier - 1
        if kind == CHECKPOINT:
            old = node._state[t]
            node._state[t] = value
        else:
            column = _own(node, t)[kind]
            old = column[j]
            column[j] = value
        delta = (value >= 0) - (old >= 0)
        if delta:
            self._count(node, t, delta)

    def set_many(self, node: Node, tier: int, kind: str, js: Sequence[int],
                 values: Sequence[int]) -> None:
        """:meth:`set` for several pages of one node."""
        column = _own(node, tier - 1)[kind]
        delta = 0
        for j, v in zip(js, values, strict=True):
            delta += (v >= 0) - (column[j] >= 0)
            column[j] = v
        if delta:
            self._count(node, tier - 1, delta)

    def clear(self, node: Node, tier: int) -> dict[str, list[int]]:
        """Remove every entry ``node`` has in ``tier``; the removed entries per kind (the
        checkpoint under "state")."""
        t = tier - 1
        out: dict[str, list[int]] = {}
        columns = node._pages[t]
        if type(columns) is _Absent:  # never written: holds no page
            out = {kind: [] for kind in columns}
        else:
            n = len(node.keys)
            # Page entries held (the counts say it: columns left held whole or empty need no
            # scan for ABSENT) and page entries in the columns not read yet.
            left, rest = node._held[t] - (node._state[t] >= 0), n * len(columns)
            for kind, column in columns.items():  # private columns are lists
                if left == rest or (left and ABSENT not in column):
                    out[kind] = column  # type: ignore[assignment]  # held whole: handed back
                    left -= n
                else:
                    out[kind] = [v for v in column if v >= 0] if left else []
                    left -= len(out[kind])
                rest -= n
            node._pages[t] = _ABSENT_COLUMNS.get(n) or _absent(n)  # (the call when new)
        sid = node._state[t]
        out[CHECKPOINT] = [sid] if sid >= 0 else []
        node._state[t] = ABSENT
        if node._held[t]:  # _count(node, t, -held) inlined (an eviction a request)
            node._held[t] = 0  # holds nothing in t now: the parent has one holding child less
            parent = node.parent
            if parent is not None:
                parent._child_held[t] -= 1
                self._refresh(parent, t)
            if node.queued[t]:  # (_refresh of the node: no longer a candidate)
                self._queue_at[t].discard(node)
        return out

    def _count(self, node: Node, t: int, delta: int) -> None:
        before = node._held[t] > 0
        node._held[t] += delta
        assert node._held[t] >= 0, "held count went negative"
        if (node._held[t] > 0) != before:
            parent = node.parent
            if parent is not None:
                parent._child_held[t] += 1 if not before else -1
                self._refresh(parent, t)
        self._refresh(node, t)

    def _refresh(self, node: Node, t: int) -> None:
        """Put ``node`` on / take it off tier ``t``'s eviction queue as its eligibility says
        (:meth:`Node.evictable`, inlined: this runs on every residency change)."""
        if (node.lock == 0 and node._held[t] > 0 and node._child_held[t] == 0
                and node.parent is not None):
            if not node.queued[t]:
                self._queue_at[t].push(node)
        elif node.queued[t]:
            self._queue_at[t].discard(node)

    def _refresh_all(self, node: Node) -> None:
        """:meth:`_refresh` of every tier (inlined: this runs on each lock change of a node)."""
        held, queued, child = node._held, node.queued, node._child_held
        free = node.lock == 0 and node.parent is not None
        for t in _TIER_AT:
            if held[t] or queued[t]:  # neither: not a candidate and not queued, nothing to do
                if free and held[t] > 0 and child[t] == 0:
                    if not queued[t]:
                        self._queue_at[t].push(node)
                elif queued[t]:
                    self._queue_at[t].discard(node)

    # ---------------------------------------------------------------- mutation
    def split(self, node: Node, pages: int) -> Node:
        """Cut ``node`` after its first ``pages`` pages; return the new upper node (which ends
        there). The lower part keeps the checkpoint and children."""
        assert 0 < pages < len(node.keys), f"split at {pages} of {len(node.keys)} pages"
        parent = node.parent
        assert parent is not None
        upper = Node(parent, node.depth, node.keys[:pages])
        upper.lock, upper.last_use, upper.used_at = node.lock, node.last_use, node.used_at
        upper.hits, upper.priority = node.hits, node.priority
        held_before = list(node._held)
        rest = _absent(len(node.keys) - pages)
        for t in range(len(TIERS)):
            columns = node._pages[t]
            if type(columns) is _Absent:  # upper starts with the shared empty columns
                node._pages[t] = rest
                upper._held[t] = 0
                upper._child_held[t] = int(node._held[t] > 0)
                continue
            upper._pages[t] = {kind: column[:pages] for kind, column in columns.items()}
            node._pages[t] = {kind: column[pages:] for kind, column in columns.items()}
            up = sum(v >= 0 for col in upper._pages[t].values() for v in col)
            upper._held[t] = up
            node._held[t] -= up
            upper._child_held[t] = int(node._held[t] > 0)
        parent.children[upper.keys[0]] = upper
        node.keys = node.keys[pages:]
        node.depth += pages
        node.parent = upper
        upper.children[node.keys[0]] = node
        self.num_nodes += 1
        for t in range(len(TIERS)):  # the parent's child is now `upper`
            parent._child_held[t] += int(upper._held[t] > 0) - int(held_before[t] > 0)
            self._refresh(parent, t)
        self._refresh_all(upper)
        self._refresh_all(node)
        return upper

    def node_ending_at(self, path: list[Segment]) -> Node:
        """The node whose end is the end of ``path`` (splitting the last node when the path
        stops inside it); the root for an empty path."""
        if not path:
            return self.root
        last = path[-1]
        if last.pages < len(last.node.keys):
            return self.split(last.node, last.pages)
        return last.node

    def extend(self, parent: Node, keys: list[bytes], entries: dict[str, list[int]] | None
               = None, tier: int = Tier.L1) -> Node:
        """Hang a new leaf with ``keys`` under ``parent`` (which has no child for keys[0]);
        ``entries`` ({kind: per-page entries}) are its residency in ``tier``."""
        assert keys and keys[0] not in parent.children, "extend needs a fresh branch"
        leaf = Node(parent, parent.end, list(keys))
        leaf.last_use, leaf.priority = parent.last_use, parent.priority
        parent.children[keys[0]] = leaf
        self.num_nodes += 1
        self.num_pages += len(keys)
        if entries:
            self.fill(leaf, tier, entries)
        return leaf

    def grow(self, parent: Node, keys: list[bytes], tier: int, columns: dict[str, Sequence[int]],
             held: int, now: float, priority: int, wall: float) -> Node:
        """:meth:`extend` then :meth:`fill` for an insert's new leaf, with a :meth:`touch` of it
        (``now``, ``priority``, ``wall``; not a hit) in between: the leaf joins its eviction
        queue once, at its touched key. ``keys`` and ``columns`` (every page kind, entries >= 0
        or ABSENT; ``held`` entries >= 0 in all, as the caller counted them) become the leaf's
        own lists: the caller hands them over and keeps no reference it writes to."""
        assert keys and keys[0] not in parent.children, "grow needs a fresh branch"
        n = len(keys)
        leaf = Node(parent, parent.depth + len(parent.keys), keys)
        parent.children[keys[0]] = leaf
        self.num_nodes += 1
        self.num_pages += n
        self.touch(leaf, now, priority, hit=False, wall=wall)  # (sets the leaf's clocks)
        t = tier - 1
        assert len(columns) == len(PAGE_KINDS), f"columns {list(columns)}"
        leaf._pages[t] = columns
        if held:  # _count for a leaf that held nothing in the tier: the parent gains a child
            leaf._held[t] = held
            parent._child_held[t] += 1
            # _refresh of both, inlined: the parent now has a holding child (not a candidate);
            # the unlocked new leaf holds entries and has no child (a candidate)
            queue = self._queue_at[t]
            if parent.queued[t]:
                queue.discard(parent)
            if not leaf.queued[t]:
                queue.push(leaf)
        return leaf

    def fill(self, node: Node, tier: int, entries: dict[str, list[int]]) -> None:
        """Record whole columns ({kind: per-page entries, each >= 0 or ABSENT}) of a node that
        holds no page entry in ``tier`` yet (a new leaf): one count update, not one per page."""
        t, n = tier - 1, len(node.keys)
        held, pages = 0, node._pages[t]
        if type(pages) is _Absent:  # a new leaf: its columns hold nothing yet
            pages = {k: list(entries[k]) if k in entries else list(v) for k, v in pages.items()}
            for kind, values in entries.items():
                assert len(values) == n and kind in pages, f"{kind}: {len(values)} entries"
                held += n - values.count(ABSENT)
        else:
            for kind, values in entries.items():
                assert len(values) == n, f"{kind}: {len(values)} entries, {n} pages"
                assert pages[kind].count(ABSENT) == n, f"{kind}: the column is not empty"
                pages[kind] = list(values)
                held += n - values.count(ABSENT)
        node._pages[t] = pages
        if held:
            self._count(node, t, held)

    def remove_leaf(self, node: Node) -> None:
        """Detach an unlocked leaf that holds nothing (its ids were handed back)."""
        parent = node.parent  # (is_leaf and holds_any inlined: this runs per eviction)
        assert parent is not None and not node.children and node.lock == 0, \
            "only unlocked leaves are removed"
        assert not any(node._held), "a removed leaf must hold nothing"
        del parent.children[node.keys[0]]
        node.parent = None
        self.num_nodes -= 1
        self.num_pages -= len(node.keys)

    def lock(self, node: Node, delta: int) -> None:
        """Add ``delta`` (+1 / -1) to the lock count of ``node`` and every ancestor."""
        n: Node | None = node
        root = self.root
        while n is not None and n is not root:
            was = n.lock
            n.lock += delta
            assert n.lock >= 0, "lock count went negative"
            if (was == 0) != (n.lock == 0):
                self._refresh_all(n)
            n = n.parent

    def touch(self, node: Node, now: float, priority: int, *, hit: bool, wall: float = 0.0
              ) -> None:
        """Record a use of the path ending at ``node`` (a ``hit`` when a match served it);
        queued nodes move to their new place in the eviction order."""
        n: Node | None = node
        root = self.root
        queue_at = self._queue_at
        while n is not None and n is not root:
            n.last_use = now
            n.used_at = wall
            n.hits += hit
            n.priority = priority
            if any(n.queued):
                for t, stamp in enumerate(n.queued):
                    if stamp:
                        queue_at[t].push(n)  # a new entry; the old one goes stale
            n = n.parent

    # ------------------------------------------------------------------- walks
    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def path_to(self, node: Node) -> list[Node]:
        """Nodes from the root's child down to ``node``."""
        out: list[Node] = []
        n: Node | None = node
        while n is not None and n is not self.root:
            out.append(n)
            n = n.parent
        return out[::-1]
