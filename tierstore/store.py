"""``TierStore``: the library entry point (L1 = the unified arena).

The store owns its parts: the arena (L1), the host tier (L2), the Redis bridge (L3), the
prefix index, a :class:`~tierstore.movement.Mover` (demotion, promotion, prefetch, L3
discovery) and a :class:`~tierstore.ledger.Ledger` (block ownership and counters). Input
checks are the plain functions of :mod:`tierstore.checks`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence

import torch

from gpu_arena import Arena, Fence, PoolSpec
from host_tier import HostTier
from tierstore import checks, integrity, rule
from tierstore.attribution import Explanation, attribution_for
from tierstore.bytes_insert import insert_bytes
from tierstore.checks import Blocks
from tierstore.config import StoreConfig
from tierstore.disk import DiskBridge
from tierstore.errors import LeaseError
from tierstore.eviction import make_policy
from tierstore.hashing import PageHasher, check_namespace
from tierstore.layout import ModelLayout
from tierstore.ledger import Ledger
from tierstore.link import link
from tierstore.movement import Mover
from tierstore.mrc import shadow_for
from tierstore.radix import CHECKPOINT, TIER_NAMES, Node, RadixIndex, Segment, Tier
from tierstore.remote import RemoteBridge
from tierstore.results import (
    Allocation,
    InsertResult,
    Lease,
    MatchResult,
    PrefixRead,
    StoreStats,
    allocation,
    insert_result,
    match_result,
)

log = logging.getLogger(__name__)

KINDS = ("kv", "swa", "state")
_ANCHOR = {"state": "low", "swa": "float", "kv": "high"}
_EMPTY = torch.empty(0, dtype=torch.long)


class TierStore:
    """A prefix cache for one model layout over one unified arena (L1), optionally backed by
    host memory (L2) and Redis (L3).

    Engines call :meth:`match` when a request arrives (and hold the lease while reading the
    prefix), :meth:`allocate` for the blocks the request computes (evicting cached prefixes as
    the stopping rule says), :meth:`insert` when it finishes (handing the blocks to the cache),
    and :meth:`release`. Bad input raises a :class:`~tierstore.errors.TierStoreError` and changes
    nothing. Not thread-safe: call it from one thread at a time.
    """

    def __init__(self, layout: ModelLayout, config: StoreConfig) -> None:
        self.layout = layout
        self.config = config
        envelopes = layout.envelopes()
        self.kinds = tuple(k for k in KINDS if k in envelopes)
        self._units = {k: envelopes[k].nbytes for k in self.kinds}
        shares = dict(config.pool_shares or ())
        pools = [PoolSpec(k, envelopes[k].nbytes, _ANCHOR[k],  # type: ignore[arg-type]
                          max_bytes=int(config.capacity_bytes * shares[k]) if k in shares
                          else None) for k in self.kinds]
        self.arena = Arena(config.capacity_bytes, pools, config.device)
        self.host = HostTier(config.host_capacity_bytes, pools) \
            if config.host_capacity_bytes else None
        self.remote = RemoteBridge(config.remote, layout.fingerprint) if config.remote else None
        self.disk = DiskBridge(config, self._units, layout.fingerprint) \
            if config.disk_path else None
        self.policy = make_policy(config.eviction)
        self.index = RadixIndex(self.policy.key)
        self.hasher = PageHasher(layout.name, layout.fingerprint, layout.page_size,
                                 config.hash_algorithm)
        self.ledger = Ledger(self.kinds, lambda kind: set(
            integrity.named_ids(self.index, Tier.L1, (kind,))[kind]))
        self.mover = Mover(self.arena, self.host, self.remote, self.index, layout, self.ledger,
                           config, self.disk)
        # Tiers a match may use: all, and those that never block (L3 can)
        self._every: tuple[int, ...] = (1, 2, 3, 4) if self.disk else (1, 2, 3)
        self._near: tuple[int, ...] = (1, 2, 4) if self.disk else (1, 2)
        if self.disk is not None:  # what a previous run left on disk hits again
            self.disk.rebuild(self.index, self.disk.tier.recovered)
        # Why matches missed (its ghost hears of drops); a null object when switched off.
        self.attribution = attribution_for(layout, config.attribution)
        self.mover.on_drop = self.attribution.on_drop
        retention = config.swa_retention
        if retention == "auto":
            retention = "window" if layout.state is not None else "all"
        self._swa_window_only = retention == "window"
        self._tick = 0
        self._window = layout.swa_window_pages()
        # Read on every request (the config is frozen)
        self._max_tokens = config.max_tokens
        self._best_effort = config.prefetch == "best_effort"
        self._timeout = config.prefetch_timeout_s if config.prefetch == "timeout" else None
        self._write_through = config.write_policy == "write_through"
        self._selective = config.write_policy == "write_through_selective"
        self._swa, self._state = layout.swa is not None, layout.state is not None
        # What 0.5x-4x of each tier would hit.
        self.mrc = shadow_for(config, layout, swa_window_only=self._swa_window_only)

    def close(self) -> None:
        """Stop the L3 connection thread and the disk tier's workers (the arenas need no
        closing)."""
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            self.disk.close()

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================== lookup
    def match(self, tokens: object, namespace: str = "default", *, priority: int = 0
              ) -> MatchResult:
        """The longest usable cached prefix of ``tokens``, brought into L1 and locked with a
        lease (when non-empty).

        A prefix of P pages is usable when its KV pages are present in some tier, a state
        checkpoint sits at exactly P (models with recurrent layers), and the SWA pages of the
        window before P are present (models with SWA layers). Parts in L2/L3 are promoted into
        L1, evicting per the stopping rule; if they cannot be, the result falls back to what L1
        alone serves."""
        got = self.hasher.prompt(tokens, namespace, self._max_tokens)  # (checked in one call)
        if got is None:  # anything else: checked and converted step by step (names errors)
            toks = checks.tokens(tokens, self._max_tokens)
            got = len(toks), self.hasher.pages(toks, check_namespace(namespace))
        n_tokens, keys = got
        prefetch = self.mover.prefetch
        best_effort, timeout = self._best_effort, self._timeout
        if prefetch is not None:
            prefetch.pump()
            if best_effort:
                prefetch.discover_later(keys)
            else:
                prefetch.discover(keys, timeout)
        self.ledger.queried(n_tokens)
        self.mrc.reference(keys, n_tokens)
        near, every = self._near, self._every  # the disk counts only when there is one
        tiers: tuple[int, ...] = near if best_effort else every
        full = None  # pages the rule allows counting every tier (for attribution)
        if best_effort and prefetch is not None:
            full = deeper = self._usable(self.index.walk(keys), every)[0]
            if deeper > self._usable(self.index.walk(keys), tiers)[0]:
                prefetch.prefetch(keys, deeper)
        why: Explanation | None = None
        plans: list[tuple[int, str]] = []  # (pages planned, promotion status) per try
        path = self.index.walk(keys)
        held = rule.held_in_l1(path, swa=self._swa, state=self._state, window=self._window)
        if held is not None:  # the common hit: L1 holds the whole path, the rule keeps it all
            pages = held[0]
            # nothing to promote: what Mover.promote returns for it
            sources = {1: pages, 2: 0, 3: 0, 4: 0} if self.disk is not None \
                else {1: pages, 2: 0, 3: 0}
            # (settled before node_ending_at may split what the walk saw)
            settled = self.attribution.settle_held(namespace, n_tokens, keys, path, pages,
                                                   sources) if full is None else \
                self.attribution.settle(namespace, n_tokens, len(keys),
                                        self.attribution.explain(path, keys, full),
                                        [(pages, "ok")], pages, sources)
            node = self.index.node_ending_at(path)  # (a split keeps the ids held found)
            self.index.lock(node, +1)
            if self._selective:  # (write-through after N hits: _hit backs the nodes up)
                return self._hit(node, path, pages, pages, sources, priority, settled, held)
            # what _hit does for an all-L1 hit, without its call
            self._tick += 1
            self.index.touch(node, float(self._tick), priority, hit=True, wall=time.monotonic())
            hit = pages * self.layout.page_size
            self.ledger.hit_l1(hit)
            return match_result(hit, pages, held[1], held[2],
                                node.checkpoint(1) if self._state else None, Lease(node, self),
                                pages, {"l1": hit, "l2": 0, "l3": 0}, *settled)
        found = 0
        for attempt in range(4):
            if attempt:  # the failed try changed the index (splits, absent marks)
                path = self.index.walk(keys)
            pages, found = self._usable(path, tiers)
            if why is None:  # before promotion splits or prunes what the walk saw
                why = self.attribution.explain(path, keys, pages if full is None else full)
            if pages == 0:
                plans.append((0, "none"))
                break
            last = path[-1]
            if pages < last.node.depth + last.pages:  # (else the cut is the path itself)
                path = rule.cut(path, pages)
            node = self.index.node_ending_at(path)
            if path[-1].node is not node:  # split: the cut's last node is now the upper part
                path[-1] = Segment(node, path[-1].pages)
            self.index.lock(node, +1)
            status, sources = self.mover.promote(path, pages, timeout)
            plans.append((pages, status))
            if status == "ok":
                return self._hit(node, path, pages, found, sources, priority,
                                 self.attribution.settle(namespace, n_tokens, len(keys), why,
                                                         plans, pages, sources))
            self.index.lock(node, -1)
            if status == "no_room":  # L1 cannot take the lower tiers' part: serve L1 alone
                tiers = (1,)
            elif status == "unavailable":  # Redis is down or slow: serve L1 + L2 this time
                tiers = near
            # "partial": entries missing in L3 are now marked absent there; plan again
        else:  # four failed tries: what the tiers serve now
            _, found = self._usable(self.index.walk(keys), tiers)
        self.ledger.miss()
        assert why is not None, "the match loop runs at least once"
        lost, evicted = self.attribution.settle(namespace, n_tokens, len(keys), why, plans, 0,
                                                {})
        return match_result(0, 0, _EMPTY, _EMPTY, None, None, found, {}, lost, evicted)

    def _hit(self, node: Node, path: list[Segment], pages: int, found: int,
             sources: dict[int, int], priority: int,
             lost: tuple[dict[str, int], dict[str, int]],
             held: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> MatchResult:
        """Build the result of a promoted, locked prefix and count it per tier (``held``:
        :func:`rule.held_in_l1` of it, when L1 held it all)."""
        self._tick += 1  # (what _touch does, without its call)
        self.index.touch(node, float(self._tick), priority, hit=True, wall=time.monotonic())
        page = self.layout.page_size
        if sources[1] == pages and 4 not in sources:  # all from L1: the common hit
            self.ledger.hit_l1(pages * page)
            tiers = {"l1": pages * page, "l2": 0, "l3": 0}
        else:
            self.ledger.hit({t: n * page for t, n in sources.items()})
            tiers = {TIER_NAMES[t]: n * page for t, n in sources.items()}
        if self._selective:
            for n in self.index.path_to(node):
                if n.hits == self.config.write_through_hits:
                    self.mover.backup(n)
        state = node.checkpoint(1) if self._state else None  # (L1: Tier.L1 costs a lookup)
        kv, swa = (held[1], held[2]) if held is not None \
            else (rule.l1_ids(path, "kv"), rule.l1_ids(path, "swa"))
        return match_result(pages * page, pages, kv, swa, state, Lease(node, self), found,
                            tiers, *lost)

    def read_prefix(self, tokens: object, namespace: str = "default") -> PrefixRead:
        """:meth:`match`, then the matched rows pinned for reading (see
        :class:`~tierstore.results.PrefixRead`): what a server streams to a client without
        copying. The caller must :meth:`PrefixRead.close` it on the store's thread."""
        result = self.match(tokens, namespace)
        fences: list[Fence] = []
        rows: dict[str, list[torch.Tensor | None]] = {}
        done = functools.partial(self._end_read, result.lease, fences)
        try:
            swa = result.swa.tolist()
            for kind, ids in (("kv", result.kv.tolist()), ("swa", [i for i in swa if i >= 0]),
                              ("state", [] if result.state is None else [result.state])):
                if ids:
                    fences.append(self.arena.fence(kind, ids, "read"))
                    rows[kind] = list(self.arena.rows(kind, ids))
            if "swa" in rows:
                present = iter(rows["swa"])
                rows["swa"] = [next(present) if i >= 0 else None for i in swa]
        except BaseException:
            done()
            raise
        return PrefixRead(result, rows, done)

    def _end_read(self, lease: Lease | None, fences: list[Fence]) -> None:
        for fence in fences:
            fence.complete()
        if lease is not None:
            self.release(lease)

    def peek(self, tokens: object, namespace: str = "default", *, tiers: tuple[int, ...] = (1,)
             ) -> int:
        """Tokens of ``tokens`` that are cached now in ``tiers`` (default L1 only) under the
        hybrid rule. Changes nothing: no lease, no promotion, no use recorded, no counters."""
        toks = checks.tokens(tokens, self.config.max_tokens)
        path = self.index.walk(self.hasher.pages(toks, check_namespace(namespace)))
        return self._usable(path, tiers)[0] * self.layout.page_size

    def _usable(self, path: list[Segment], tiers: Sequence[int]) -> tuple[int, int]:
        """Deepest prefix length (pages) the hybrid match rule accepts, and the consecutive KV
        pages present; an entry counts as present when one of ``tiers`` holds it."""
        return rule.usable(path, tiers, swa=self._swa, state=self._state, window=self._window)

    def demote_idle(self, idle_s: float) -> int:
        """Demote from L1 every unlocked prefix unused for ``idle_s`` seconds (to L2 / L3 when
        present, else drop it), deepest first; returns how many nodes left L1. An idle loop
        or the service calls this to keep L1 for hot prefixes."""
        return self.mover.demote_idle(time.monotonic() - idle_s)

    def release(self, lease: Lease) -> None:
        """Unlock a matched prefix. Releasing twice, or another store's lease, raises."""
        if not isinstance(lease, Lease) or lease.owner is not self:
            raise LeaseError("lease does not belong to this store")
        if lease.released:
            raise LeaseError("lease already released")
        lease.released = True
        self.index.lock(lease.node, -1)

    # ============================================================= allocation
    def allocate(self, demand: Mapping[str, int]) -> Allocation | None:
        """Fresh blocks ({kind: count}) for a running request, evicting unlocked cached
        prefixes per the stopping rule; ``None`` when even evicting everything unlocked cannot
        make room (what was evicted stays evicted)."""
        demand = checks.demand(self.kinds, demand)
        taken = self.mover.take_room(demand)  # (evicts; usually allocates too, in one call)
        if taken is None:
            return None
        alloc, hand_out = self.arena.alloc_packed, self.ledger.hand_out_fresh
        blocks = {}
        for kind, n in demand.items():
            got = taken[kind] if taken else alloc(kind, n)
            assert got is not None, f"can_alloc promised {demand}, {kind} failed"
            ids, packed = got
            # (n >= 1: demand drops zeros. The bytearray is the tensor's alone.)
            blocks[kind] = torch.frombuffer(packed, dtype=torch.long)
            hand_out(kind, ids)
        return allocation(blocks)

    def free(self, kind: str, ids: Blocks) -> None:
        """Return blocks from :meth:`allocate` that will not be inserted."""
        id_list = checks.ids(kind, self.kinds, ids)
        self.ledger.take_back(kind, id_list)
        if id_list:
            self.arena.free(kind, id_list)

    # ================================================================= insert
    def insert(self, tokens: object, namespace: str = "default", *, kv: Blocks = None,
               swa: Blocks = None, state: Blocks | int = None, priority: int = 0
               ) -> InsertResult:
        """Cache the full pages of ``tokens``.

        ``kv`` covers the *last* ``len(kv)`` pages: every page, or only those past what is
        cached already (an engine sends the pages its request computed). ``swa`` covers the
        last ``len(swa)`` pages, and ``state`` is one checkpoint at exactly ``len(tokens)``
        (which must then be page-aligned). Each is either L1 ids from :meth:`allocate` / a
        match (ownership passes to the cache; duplicates of cached pages are freed) or envelope
        bytes, a ``uint8`` tensor ``[n, envelope bytes]`` (copied into fresh blocks, evicting as
        needed; ``stored=False`` when they do not fit).
        """
        got = self.hasher.prompt(tokens, namespace, self._max_tokens)  # (checked in one call)
        if got is None:  # anything else: checked and converted step by step (names errors)
            toks = checks.tokens(tokens, self._max_tokens)
            got = len(toks), self.hasher.pages(toks, check_namespace(namespace))
        n_tokens, keys = got
        page = self.layout.page_size
        n_pages = n_tokens // page
        # ids as allocate hands them out (1-D long tensors of this layout's kinds) pass as
        # they are, tested in one step; anything else goes through _blocks' checks
        long, tensor, kinds = torch.long, torch.Tensor, self.kinds
        given: dict[str, torch.Tensor | None]
        if (type(kv) is tensor and kv.dtype == long and kv.ndim == 1 and "kv" in kinds
                and (swa is None or (type(swa) is tensor and swa.dtype == long
                                     and swa.ndim == 1 and "swa" in kinds))
                and (state is None or (type(state) is tensor and state.dtype == long
                                       and state.ndim == 1 and "state" in kinds))):
            given = {"kv": kv, "swa": swa, "state": state}
            fast = True
        else:
            blocks = self._blocks
            given = {"kv": blocks("kv", kv), "swa": None if swa is None else blocks("swa", swa),
                     "state": None if state is None
                     else blocks("state", [state] if isinstance(state, int) else state)}
            fast = False
        index = self.index
        path = index.walk(keys)
        cached = path[-1].node.depth + path[-1].pages if path else 0
        if fast:  # what checks.counts accepts, tested inline (it names what is wrong)
            k, w, c = given["kv"], given["swa"], given["state"]
            assert k is not None, "the fast case has kv"
            fast = (n_pages - cached <= k.shape[0] <= n_pages
                    and (w is None or w.shape[0] <= n_pages)
                    and (c is None or (c.shape[0] == 1 and n_pages > 0
                                       and n_tokens == n_pages * page)))
        if not fast:
            checks.counts(given, kinds, page, n_pages, n_tokens, cached)
        lists: dict[str, list[int] | None] = {"kv": None, "swa": None, "state": None}
        as_bytes = False
        ledger = self.ledger
        adopted: list[str] = []  # kinds whose ids passed to the cache before linking
        try:
            for kind, value in given.items():
                if value is None:
                    continue
                if value.dtype == long:
                    ids = lists[kind] = value.tolist()
                    # The common case in one step, no set built: every id is the caller's
                    # (fresh from allocate) and as many leave its set as were given (none
                    # repeats). Linking keeps or frees each of them, so they go now.
                    if ledger.adopt_held(kind, ids):
                        adopted.append(kind)
                        continue
                    checks.owned_ids(kind, ids, ledger, path, n_pages)
                else:
                    as_bytes = True
            if as_bytes:  # copy into fresh blocks first, so a shortfall changes nothing
                stored = insert_bytes(self.index, self.mover, self.arena, self.ledger, given, lists,
                                      keys, path, n_pages)
                if stored is None:  # nothing is linked: the caller holds its ids again
                    for kind in adopted:
                        ledger.hand_out(kind, lists[kind])  # type: ignore[arg-type]
                    return InsertResult(False, 0, cached, False, 0, 0)
                path = stored
        except BaseException:
            for kind in adopted:  # nothing is linked yet: the caller holds them again
                ledger.hand_out(kind, lists[kind])  # type: ignore[arg-type]
            raise
        self._tick += 1  # the one touch linking makes (what _touch does, without its call)
        done = link(index, keys, path, lists, n_pages, cached,
                    window=self._window if self._swa_window_only else None,
                    now=float(self._tick), priority=priority, wall=time.monotonic())
        end, kept, spare = done.end, done.kept, done.spare
        for kind in self.kinds:
            if kind not in adopted:
                if kept[kind]:
                    ledger.adopt(kind, kept[kind])
                if spare[kind]:
                    ledger.spare(kind, spare[kind])
            if spare[kind]:  # the caller's (checked above): free without re-checking
                self.arena.free_owned(kind, spare[kind])
        duplicates = len(spare["kv"]) + len(spare["swa"]) + len(spare[CHECKPOINT]) \
            - done.dropped
        result = insert_result(True, n_pages - cached, cached, done.checkpoint, duplicates,
                               done.dropped)
        self.mrc.insert(keys, lists["state"] is not None)
        if self._write_through and end is not self.index.root:
            for node in self.index.path_to(end):
                self.mover.backup(node)
        return result

    def _blocks(self, kind: str, value: object) -> torch.Tensor | None:
        """:func:`checks.blocks` for one kind of an insert (ids from ``allocate`` as they are)."""
        if value is None:
            return None
        if (type(value) is torch.Tensor and value.dtype == torch.long and value.ndim == 1
                and kind in self.kinds):
            return value
        return checks.blocks(kind, self.kinds, value, self._units.get(kind))

    # ============================================================= inspection
    def stats(self) -> StoreStats:
        """Counters since start and occupancy now."""
        ledger = self.ledger
        return StoreStats(ledger.requests, ledger.requests_hit, ledger.tokens_queried,
                          ledger.tokens_hit, ledger.evictions, dict(ledger.evicted),
                          self.index.num_nodes, self.index.num_pages, self.arena.stats(),
                          self.config.stop_rule, dict(ledger.hit_tokens),
                          dict(ledger.hit_requests), dict(ledger.moved),
                          self.host.arena.stats() if self.host else None,
                          self.remote.stats() if self.remote else None,
                          disk=self.disk.tier.snapshot() if self.disk else None,
                          attribution=self.attribution.snapshot(), mrc=self.mrc.curves())

    def check_integrity(self) -> None:
        """Raise IntegrityError if the arena, the index (its eviction queues included) or their
        agreement with the ledger is broken (:func:`tierstore.integrity.check_store`)."""
        integrity.check_store(self.arena, self.index, self.ledger, self.host, self.kinds)

    # =============================================================== helpers
    def _touch(self, node: Node, priority: int, *, hit: bool) -> None:
        self._tick += 1
        self.index.touch(node, float(self._tick), priority, hit=hit, wall=time.monotonic())

