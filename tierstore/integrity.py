"""Consistency checks of a store and its prefix index (tests, soak runs and ``--check``).

Kept apart from the hot paths they check: :meth:`TierStore.check_integrity` calls
:func:`check_store`, which checks the index with :func:`check_index`.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_arena import Arena, IntegrityError
from host_tier import HostTier
from tierstore.ledger import Ledger
from tierstore.radix import ABSENT, CHECKPOINT, TIERS, RadixIndex, Tier


def named_ids(index: RadixIndex, tier: int, kinds: Sequence[str]) -> dict[str, list[int]]:
    """Every id the index names in ``tier``, per kind."""
    out: dict[str, list[int]] = {k: [] for k in kinds}
    for n in index.nodes():
        for kind in kinds:
            if kind == CHECKPOINT:
                if n.checkpoint(tier) >= 0:
                    out[kind].append(n.checkpoint(tier))
            else:
                out[kind] += [v for v in n.ids(tier, kind) if v >= 0]
    return out


def check_store(arena: Arena, index: RadixIndex, ledger: Ledger, host: HostTier | None,
                kinds: Sequence[str]) -> None:
    """Raise IntegrityError if a store's arena, its index (eviction queues included) or their
    agreement with its ledger is broken: every L1 id in the index is live and cached once,
    every id handed out is live and not cached, and live = cached + handed out."""
    arena.check_integrity()
    check_index(index)
    named = {t: named_ids(index, t, kinds) for t in (Tier.L1, Tier.L2)}
    for kind in kinds:
        ids, handed = named[Tier.L1][kind], ledger.handed[kind]
        if len(ids) != len(set(ids)):
            raise IntegrityError(f"{kind}: the index names an L1 id twice")
        if not handed.isdisjoint(ids):
            raise IntegrityError(f"{kind}: ids both cached and handed out")
        live = arena.num_live(kind)
        if live != len(ids) + len(handed):
            raise IntegrityError(f"{kind}: {live} live blocks != {len(ids)} cached + "
                                 f"{len(handed)} handed out")
        for some in (ids, sorted(handed)):
            if some:
                arena.resolve(kind, some)  # raises if any is not live
    if host is not None:
        host.check_integrity()
        for kind in kinds:
            held = named[Tier.L2][kind]
            if len(held) != len(set(held)) or len(held) != host.arena.num_live(kind):
                raise IntegrityError(f"{kind}: L2 holds {host.arena.num_live(kind)} "
                                     f"blocks, the index names {len(held)}")


def check_index(index: RadixIndex) -> None:
    """Raise IntegrityError if the tree's structure, its counts or the eviction queues are
    inconsistent (the queues against a full scan of the tree)."""
    nodes = pages = 0
    for n in index.nodes():
        nodes += 1
        pages += len(n.keys)
        parent = n.parent
        _require(parent is not None and parent.children.get(n.keys[0]) is n,
                 "node not linked from its parent under its first key")
        assert parent is not None
        _require(n.depth == parent.end, f"depth {n.depth} != parent end {parent.end}")
        _require(len(n.keys) > 0 and all(len(col) == len(n.keys) for per in n._pages
                                         for col in per.values()),
                 f"node of {len(n.keys)} pages has columns of other lengths")
        _require(all(min(col, default=0) >= ABSENT for per in n._pages for col in per.values())
                 and min(n._state) >= ABSENT, f"{n!r}: an entry below ABSENT")
        _require(n.lock >= 0 and all(n.lock >= c.lock for c in n.children.values()),
                 "a child holds more locks than its parent")
        _require(all(k == c.keys[0] for k, c in n.children.items()), "child keyed wrongly")
        for t in range(len(TIERS)):
            held = sum(v >= 0 for col in n._pages[t].values() for v in col) \
                + (n._state[t] >= 0)
            _require(held == n._held[t], f"{n!r}: tier {t + 1} holds {held}, counted "
                                         f"{n._held[t]}")
            kids = sum(c._held[t] > 0 for c in n.children.values())
            _require(kids == n._child_held[t], f"{n!r}: {kids} children hold tier {t + 1}, "
                                               f"counted {n._child_held[t]}")
    _require(nodes == index.num_nodes and pages == index.num_pages,
             f"counted {nodes} nodes / {pages} pages, recorded {index.num_nodes} / "
             f"{index.num_pages}")
    for tier, queue in index.queues.items():
        want = {id(n) for n in index.nodes() if n.evictable(tier)}
        _require({id(n) for n in queue.members()} == want,
                 f"tier {tier}: the eviction queue disagrees with a scan of the tree")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
