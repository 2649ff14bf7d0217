"""Radix prefix index at page granularity.

A node owns a run of pages (chained page keys) and, per page and per tier, where its ``kv`` and
``swa`` envelopes live: L1 and L2 virtual ids (-1: absent), and for L3 a presence flag (1 / -1;
the Redis key derives from the page key). An absent ``swa`` page beside a present ``kv`` page is
a *tombstone*. A recurrent-state checkpoint exists only at a node's end, again per tier. Locks
propagate to the root, so a locked node's ancestors are locked too. The index only records
where things are; it never frees or copies blocks: the store decides.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpu_arena import IntegrityError

_serial = itertools.count()

PAGE_KINDS = ("kv", "swa")
TIERS = (1, 2, 3)
# Per-page columns: L1 ids keep the short names.
COLUMNS = tuple(k if t == 1 else f"{k}{t}" for t in TIERS for k in PAGE_KINDS)


@dataclass(eq=False)
class Node:
    """A run of pages; ``depth`` counts the pages above it (its first page's position)."""

    parent: Node | None
    depth: int
    keys: list[bytes] = field(default_factory=list)
    kv: list[int] = field(default_factory=list)  # L1 ids
    swa: list[int] = field(default_factory=list)
    kv2: list[int] = field(default_factory=list)  # L2 ids
    swa2: list[int] = field(default_factory=list)
    kv3: list[int] = field(default_factory=list)  # L3: 1 present, -1 absent
    swa3: list[int] = field(default_factory=list)
    state: int = -1  # checkpoint at this node's end: L1 id, -1 when none
    state2: int = -1  # L2 id
    state3: int = -1  # L3: 1 present
    children: dict[bytes, Node] = field(default_factory=dict)
    lock: int = 0
    last_use: float = 0.0  # logical clock: orders LRU deterministically
    used_at: float = 0.0  # wall clock (time.monotonic), for idle demotion
    hits: int = 0
    priority: int = 0
    serial: int = field(default_factory=lambda: next(_serial))  # creation order: ties broken

    @property
    def end(self) -> int:
        """Position (in pages) just past this node's last page."""
        return self.depth + len(self.keys)

    def is_leaf(self) -> bool:
        return not self.children and self.parent is not None

    def col(self, kind: str, tier: int) -> list[int]:
        """Per-page column of ``kind`` ("kv" / "swa") in ``tier`` (1, 2, 3)."""
        return getattr(self, kind if tier == 1 else f"{kind}{tier}")  # type: ignore[no-any-return,unused-ignore]

    def checkpoint(self, tier: int) -> int:
        """The checkpoint entry at this node's end in ``tier`` (-1: none)."""
        return self.state if tier == 1 else self.state2 if tier == 2 else self.state3

    def set_checkpoint(self, tier: int, value: int) -> None:
        setattr(self, "state" if tier == 1 else f"state{tier}", value)

    def holds(self, tier: int) -> bool:
        """Whether anything of this node lives in ``tier``."""
        return self.checkpoint(tier) >= 0 or any(
            v >= 0 for kind in PAGE_KINDS for v in self.col(kind, tier))

    def holds_any(self) -> bool:
        return any(self.holds(t) for t in TIERS)


@dataclass(frozen=True)
class Segment:
    """``pages`` pages matched at the start of ``node``."""

    node: Node
    pages: int


class RadixIndex:
    """The tree. Every mutation keeps :meth:`check_integrity` true."""

    def __init__(self) -> None:
        self.root = Node(parent=None, depth=0)
        self.num_nodes = 0
        self.num_pages = 0

    # ------------------------------------------------------------------ lookup
    def walk(self, keys: list[bytes]) -> list[Segment]:
        """The longest run of ``keys`` present in the tree, as segments along one path.
        Changes nothing."""
        path: list[Segment] = []
        node, pos = self.root, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            n = 0
            limit = min(len(child.keys), len(keys) - pos)
            while n < limit and child.keys[n] == keys[pos + n]:
                n += 1
            path.append(Segment(child, n))
            pos += n
            if n < len(child.keys):
                break
            node = child
        return path

    # ---------------------------------------------------------------- mutation
    def split(self, node: Node, pages: int) -> Node:
        """Cut ``node`` after its first ``pages`` pages; return the new upper node (which ends
        there). The lower part keeps the checkpoint and children."""
        assert 0 < pages < len(node.keys), f"split at {pages} of {len(node.keys)} pages"
        parent = node.parent
        assert parent is not None
        upper = Node(parent=parent, depth=node.depth, keys=node.keys[:pages], lock=node.lock,
                     last_use=node.last_use, used_at=node.used_at, hits=node.hits,
                     priority=node.priority)
        for name in COLUMNS:
            column = getattr(node, name)
            setattr(upper, name, column[:pages])
            setattr(node, name, column[pages:])
        parent.children[upper.keys[0]] = upper
        node.keys = node.keys[pages:]
        node.depth += pages
        node.parent = upper
        upper.children[node.keys[0]] = node
        self.num_nodes += 1
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

    def extend(self, parent: Node, keys: list[bytes], **columns: list[int]) -> Node:
        """Hang a new leaf with ``keys`` under ``parent`` (which has no child for keys[0]);
        ``columns`` (e.g. ``kv=[...]``) default to absent."""
        assert keys and keys[0] not in parent.children, "extend needs a fresh branch"
        leaf = Node(parent=parent, depth=parent.end, keys=list(keys),
                    last_use=parent.last_use, priority=parent.priority)
        for name in COLUMNS:
            values = columns.pop(name, None)
            assert values is None or len(values) == len(keys), f"{name}: length differs"
            setattr(leaf, name, list(values) if values is not None else [-1] * len(keys))
        assert not columns, f"unknown columns {sorted(columns)}"
        parent.children[keys[0]] = leaf
        self.num_nodes += 1
        self.num_pages += len(keys)
        return leaf

    def remove_leaf(self, node: Node) -> None:
        """Detach an unlocked leaf (its ids must have been handed back by the caller)."""
        assert node.is_leaf() and node.lock == 0, "only unlocked leaves are removed"
        parent = node.parent
        assert parent is not None
        del parent.children[node.keys[0]]
        node.parent = None
        self.num_nodes -= 1
        self.num_pages -= len(node.keys)

    def lock(self, node: Node, delta: int) -> None:
        """Add ``delta`` (+1 / -1) to the lock count of ``node`` and every ancestor."""
        n: Node | None = node
        while n is not None and n is not self.root:
            n.lock += delta
            assert n.lock >= 0, "lock count went negative"
            n = n.parent

    def touch(self, node: Node, now: float, priority: int, *, hit: bool, wall: float = 0.0
              ) -> None:
        """Record a use of the path ending at ``node`` (a ``hit`` when a match served it)."""
        n: Node | None = node
        while n is not None and n is not self.root:
            n.last_use = now
            n.used_at = wall
            n.hits += int(hit)
            n.priority = priority
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

    def check_integrity(self) -> None:
        """Raise IntegrityError if the tree's structure or counts are inconsistent."""
        nodes = pages = 0
        for n in self.nodes():
            nodes += 1
            pages += len(n.keys)
            parent = n.parent
            _require(parent is not None and parent.children.get(n.keys[0]) is n,
                     "node not linked from its parent under its first key")
            assert parent is not None
            _require(n.depth == parent.end, f"depth {n.depth} != parent end {parent.end}")
            _require(len(n.keys) > 0 and all(len(getattr(n, c)) == len(n.keys) for c in COLUMNS),
                     f"node of {len(n.keys)} pages has columns of other lengths")
            _require(n.lock >= 0 and all(n.lock >= c.lock for c in n.children.values()),
                     "a child holds more locks than its parent")
            _require(all(k == c.keys[0] for k, c in n.children.items()), "child keyed wrongly")
        _require(nodes == self.num_nodes and pages == self.num_pages,
                 f"counted {nodes} nodes / {pages} pages, recorded {self.num_nodes} / "
                 f"{self.num_pages}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
