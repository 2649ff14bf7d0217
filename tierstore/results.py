"""Typed results that cross the store's boundary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpu_arena import ArenaStats
from tierstore.radix import Node


class Lease:
    """Locks a matched prefix against eviction until :meth:`TierStore.release`."""

    __slots__ = ("node", "owner", "released")

    def __init__(self, node: Node, owner: object) -> None:
        self.node = node
        self.owner = owner
        self.released = False

    def __repr__(self) -> str:
        return f"Lease(end={self.node.end} pages, released={self.released})"


@dataclass(frozen=True)
class MatchResult:
    """The usable cached prefix of a request (the hybrid match rule applied).

    ``kv``/``swa`` hold L1 ids of pages ``[0, pages)`` (``swa`` is -1 for tombstoned pages
    outside the window); ``state`` is the checkpoint at exactly ``tokens``. Ids stay valid while
    ``lease`` is held; release it once the request no longer reads them."""

    tokens: int
    pages: int
    kv: torch.Tensor
    swa: torch.Tensor
    state: int | None
    lease: Lease | None
    kv_pages_found: int  # consecutive KV pages present, before the hybrid rule cut
    tiers: dict[str, int] = field(default_factory=dict)  # matched tokens by source tier
    # The other prompt tokens by reason (tierstore.attribution.REASONS; zeros left out):
    # sum(tiers.values()) + sum(lost.values()) == len(tokens). ``evicted_from`` splits
    # lost["evicted"] by the tier that dropped those pages last.
    lost: dict[str, int] = field(default_factory=dict)
    evicted_from: dict[str, int] = field(default_factory=dict)


class PrefixRead:
    """A matched prefix pinned for reading: ``rows`` holds, per kind, the arena rows of the
    match (``kv`` one per page; ``swa`` one per page, None for tombstones; ``state`` the
    checkpoint), read-fenced so compaction cannot move them and leased so eviction cannot free
    them. :meth:`close` (on the thread that calls the store) ends both; a ``with`` block does
    it for you."""

    __slots__ = ("_done", "match", "rows")

    def __init__(self, match: MatchResult, rows: dict[str, list[torch.Tensor | None]],
                 done: Callable[[], None]) -> None:
        self.match = match
        self.rows = rows
        self._done: Callable[[], None] | None = done

    def close(self) -> None:
        """Release the fences and the lease (once; later calls do nothing)."""
        done, self._done = self._done, None
        if done is not None:
            done()

    def __enter__(self) -> PrefixRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Allocation:
    """Fresh L1 blocks for a running request, by kind; owned by the caller until inserted or
    freed with :meth:`TierStore.free`."""

    blocks: dict[str, torch.Tensor]

    def __getitem__(self, kind: str) -> torch.Tensor:
        ids = self.blocks.get(kind)
        return torch.empty(0, dtype=torch.long) if ids is None else ids


@dataclass(frozen=True)
class InsertResult:
    """What an insert stored: new pages, pages already cached, whether the checkpoint was kept,
    and how many given blocks were duplicates (freed) or tombstoned SWA pages (freed)."""

    stored: bool
    new_pages: int
    cached_pages: int
    checkpoint: bool
    duplicates_freed: int
    swa_dropped: int


@dataclass(frozen=True)
class StoreStats:
    """Counters since start, plus the index and arena occupancy now."""

    requests: int
    requests_hit: int
    tokens_queried: int
    tokens_hit: int
    evictions: int
    evicted_blocks: dict[str, int]
    nodes: int
    pages: int
    arena: ArenaStats
    rule: str = field(default="unified")
    hit_tokens: dict[str, int] = field(default_factory=dict)  # per tier: l1, l2, l3
    hit_requests: dict[str, int] = field(default_factory=dict)  # deepest tier used, or miss
    moved_bytes: dict[str, int] = field(default_factory=dict)  # per direction, e.g. l1_to_l2
    host: ArenaStats | None = None
    remote: dict[str, object] | None = None
    # Prompt tokens by outcome (tierstore.attribution.Attribution.snapshot) and the miss-ratio
    # curves per tier (tierstore.mrc), when the store keeps them.
    attribution: dict[str, object] | None = None
    mrc: dict[str, object] | None = None
    disk: dict[str, object] | None = None  # the disk tier's occupancy and counters

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the cache."""
        return self.tokens_hit / self.tokens_queried if self.tokens_queried else 0.0


# The store builds a result on every request. These fill the instance's dict in one step from
# a dict display: the generated ``__init__`` sets each field through ``object.__setattr__``
# (~3x the cost), and a zip over the field names ~2x. A test checks they name every field.
_new = object.__new__


def match_result(tokens: int, pages: int, kv: torch.Tensor, swa: torch.Tensor,
                 state: int | None, lease: Lease | None, kv_pages_found: int,
                 tiers: dict[str, int], lost: dict[str, int], evicted_from: dict[str, int]
                 ) -> MatchResult:
    """``MatchResult(...)``, positionally, at a third of the cost."""
    obj = _new(MatchResult)
    obj.__dict__.update({"tokens": tokens, "pages": pages, "kv": kv, "swa": swa,
                         "state": state, "lease": lease, "kv_pages_found": kv_pages_found,
                         "tiers": tiers, "lost": lost, "evicted_from": evicted_from})
    return obj


def insert_result(stored: bool, new_pages: int, cached_pages: int, checkpoint: bool,
                  duplicates_freed: int, swa_dropped: int) -> InsertResult:
    """``InsertResult(...)``, positionally, at a third of the cost."""
    obj = _new(InsertResult)
    obj.__dict__.update({"stored": stored, "new_pages": new_pages,
                         "cached_pages": cached_pages, "checkpoint": checkpoint,
                         "duplicates_freed": duplicates_freed, "swa_dropped": swa_dropped})
    return obj


def allocation(blocks: dict[str, torch.Tensor]) -> Allocation:
    """``Allocation(blocks)`` without the generated ``__init__``'s frame (once per request)."""
    obj = _new(Allocation)
    obj.__dict__["blocks"] = blocks
    return obj
