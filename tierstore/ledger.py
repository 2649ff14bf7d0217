"""The store's one ledger: who owns which L1 blocks, and the counters of what happened.

L1 blocks are either *cached* (the index names them; the cache frees them) or *handed out*
(returned by ``allocate`` and not yet inserted or freed; the caller owns them). The ledger
records the handed-out ones; the cached ones are what the index names (it keeps no copy of
its own: a second set, updated for every page inserted and evicted, cost more per request
than the index's own bookkeeping), so ``check_integrity`` compares the index, the handed-out
set and the arena's live blocks. Every change of ownership and every counter goes through
here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tierstore.errors import ShapeError

DIRECTIONS = ("l1_to_l2", "l1_to_l3", "l2_to_l3", "l2_to_l1", "l3_to_l1", "l3_to_l2")
HIT_TIERS = ("l1", "l2", "l3")
# With a disk tier, "disk" hits and the l1/l2_to_disk, disk_to_l1/l3 moves are added on first use.
_NAMES = {1: "l1", 2: "l2", 3: "l3", 4: "disk"}


class Ledger:
    """Ownership of L1 blocks per kind, and the store's counters."""

    def __init__(self, kinds: Iterable[str], cached: Callable[[str], set[int]]) -> None:
        """``cached(kind)``: the L1 ids of ``kind`` the index names now."""
        self.kinds = tuple(kinds)
        self._cached = cached
        self._handed: dict[str, set[int]] = {k: set() for k in self.kinds}
        # Per kind, the one allocation the caller holds, as its list, while the kind's set is
        # empty: adopting exactly it back (an insert, one request in flight) builds no set.
        # Every other use reads :attr:`handed`, which folds these into the sets first.
        self._fresh: dict[str, list[int]] = {}
        self.requests = self.requests_hit = self.tokens_queried = self.tokens_hit = 0
        self.evictions = 0
        self.evicted = dict.fromkeys(self.kinds, 0)
        self.moved = dict.fromkeys(DIRECTIONS, 0)
        self.hit_tokens = dict.fromkeys(HIT_TIERS, 0)
        self.hit_requests = dict.fromkeys((*HIT_TIERS, "miss"), 0)

    # ------------------------------------------------------------------ ownership
    @property
    def handed(self) -> dict[str, set[int]]:
        """Per kind, the ids handed out and not yet inserted or freed."""
        fresh = self._fresh
        if fresh:
            for kind, ids in fresh.items():
                self._handed[kind].update(ids)
            fresh.clear()
        return self._handed

    def cached(self, kind: str) -> set[int]:
        """The L1 ids of ``kind`` the cache holds now (read from the index: O(its size), for
        integrity checks and error messages)."""
        return self._cached(kind)

    def hand_out(self, kind: str, ids: Iterable[int]) -> None:
        """Fresh blocks now belong to a caller."""
        self.handed[kind].update(ids)

    def hand_out_fresh(self, kind: str, ids: list[int]) -> None:
        """:meth:`hand_out` of ids fresh from the arena (distinct, none held before): kept as
        the list while the caller holds nothing else of ``kind`` (no set is built when
        :meth:`adopt_held` takes them back whole: one request in flight)."""
        if kind not in self._fresh and not self._handed[kind]:  # (KeyError: unknown kind)
            self._fresh[kind] = ids
        else:
            self.handed[kind].update(ids)

    def adopt_held(self, kind: str, ids: list[int]) -> bool:
        """When the caller holds every one of ``ids`` and none repeats, they pass to the cache
        (:meth:`adopt`): True. Else False, changing nothing."""
        fresh = self._fresh
        if ids == fresh.get(kind):  # exactly the one allocation held (a C compare)
            del fresh[kind]  # (its set is empty: nothing else is held)
            return True
        held = self.handed[kind]
        if not held.issuperset(ids):
            return False
        before = len(held)
        held.difference_update(ids)
        if before - len(held) == len(ids):
            return True
        held.update(ids)  # a repeat: every one was held, all go back
        return False

    def take_back(self, kind: str, ids: list[int]) -> None:
        """A caller returns blocks unused (``free``); ShapeError, changing nothing, unless
        every id is one the caller holds."""
        handed = self.handed[kind]
        foreign = [i for i in ids if i not in handed]
        if foreign:
            cached = self.cached(kind)
            owner = "the cache" if any(i in cached for i in foreign) else "nobody"
            raise ShapeError(f"{kind}: {len(foreign)} of {len(ids)} ids are not held by the "
                             f"caller (they belong to {owner}), first {foreign[0]}")
        handed.difference_update(ids)

    def adopt(self, kind: str, ids: Iterable[int]) -> None:
        """Blocks pass to the cache (the index now names them): the caller's (inserted) or
        fresh ones (promotion). Cached blocks that leave the cache need no call: the index
        stops naming them."""
        self.handed[kind].difference_update(ids)

    def spare(self, kind: str, ids: Iterable[int]) -> None:
        """Handed-out blocks the cache did not keep (duplicates); they are freed."""
        self.handed[kind].difference_update(ids)

    # ------------------------------------------------------------------ counters
    def queried(self, tokens: int) -> None:
        self.requests += 1
        self.tokens_queried += tokens

    def hit(self, tokens_by_tier: dict[int, int]) -> None:
        """A served request: matched tokens per source tier (1, 2, 3; 4: disk)."""
        self.requests_hit += 1
        total = sum(tokens_by_tier.values())
        self.tokens_hit += total
        hit = self.hit_tokens
        if tokens_by_tier.get(1) == total and 4 not in tokens_by_tier:  # all from L1
            hit["l1"] += total
            self.hit_requests["l1"] += 1
            return
        for tier, n in tokens_by_tier.items():
            name = _NAMES[tier]
            hit[name] = hit.get(name, 0) + n
        # the farthest tier (disk sits between L2 and L3) that served part of the request
        deepest = max((t for t, n in tokens_by_tier.items() if n), default=1,
                      key=lambda t: 2.5 if t == 4 else t)
        name = _NAMES[deepest]
        self.hit_requests[name] = self.hit_requests.get(name, 0) + 1

    def hit_l1(self, tokens: int) -> None:
        """A request served all from L1: :meth:`hit` with ``{1: tokens}``, without reading
        the other tiers."""
        self.requests_hit += 1
        self.tokens_hit += tokens
        self.hit_tokens["l1"] += tokens
        self.hit_requests["l1"] += 1

    def miss(self) -> None:
        self.hit_requests["miss"] += 1

    def evicted_from_l1(self, freed: dict[str, int]) -> None:
        self.evictions += 1
        for kind, n in freed.items():
            self.evicted[kind] += n

    def move(self, direction: str, nbytes: int) -> None:
        self.moved[direction] = self.moved.get(direction, 0) + nbytes
