"""The mover: demotion and promotion of cached envelopes between L1 (device arena), L2 (host
arena) and L3 (Redis), plus L3 discovery and background prefetch (:mod:`tierstore.prefetch`).

Policy, not mechanism: which node leaves a tier (the eviction queue's first candidate, leaf-first
per tier, never a locked node) and where its bytes go. Evicting from L1 copies what is not yet
in L2 down to L2 (making room there by demoting L2 leaves to L3), or straight to L3 without a
host tier; evicting from L2 writes what L3 lacks to L3. A copy kept in a lower tier stays there
after promotion, so demoting the same page again costs nothing. A node is dropped once no tier
holds any of it.

With a local disk tier (:mod:`tierstore.disk`) the chain is L1 -> L2 -> disk -> L3: L1 evicts
to L2 (to the disk when L2 cannot take it, or without a host tier), L2 evicts to the disk and
the disk to L3; a hit promotes from the nearest tier holding each entry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from tierstore import rule
from tierstore.eviction import StopCondition, victims
from tierstore.prefetch import Entry, Prefetcher
from tierstore.radix import ABSENT, CHAIN, CHECKPOINT, PAGE_KINDS, TIER_NAMES, Node, Segment, Tier

if TYPE_CHECKING:
    from gpu_arena import Arena
    from host_tier import HostTier
    from tierstore.config import StoreConfig
    from tierstore.disk import DiskBridge
    from tierstore.layout import ModelLayout
    from tierstore.ledger import Ledger
    from tierstore.radix import RadixIndex
    from tierstore.remote import RemoteBridge

log = logging.getLogger(__name__)
# Plain ints for the hot paths (an enum member read costs ~0.2-0.5 us)
_L1, _DISK = int(Tier.L1), int(Tier.DISK)
_T = TypeVar("_T")  # what a fit test answers (Mover._evict_until)


class Mover:
    """Moves a store's envelopes between its tiers; owns no state but the prefetcher's."""

    def __init__(self, arena: Arena, host: HostTier | None, remote: RemoteBridge | None,
                 index: RadixIndex, layout: ModelLayout, ledger: Ledger, config: StoreConfig,
                 disk: DiskBridge | None = None) -> None:
        self.arena = arena
        self.host = host
        self.remote = remote
        self.disk = disk
        self.index = index
        self.layout = layout
        self.ledger = ledger
        self.config = config
        self.kinds = ledger.kinds
        self.page_kinds = tuple(k for k in PAGE_KINDS if k in self.kinds)
        self._window = layout.swa_window_pages()  # (read on every match)
        self._swa, self._state = "swa" in self.page_kinds, "state" in self.kinds
        self.prefetch = Prefetcher(self) if remote is not None else None
        # L1's eviction queue, peeked directly on the hot path (one call less than next_victim)
        self._l1_queue = index.queues[Tier.L1]
        # Whether an L1 eviction copies anywhere (else it only frees: the common engine setup)
        self._lower = host is not None or disk is not None or remote is not None
        # Told (page keys, tier) of every node dropped from the last tier holding it.
        self.on_drop: Callable[[list[bytes], int], None] | None = None

    # ------------------------------------------------------------------ L1 room
    def make_room(self, demand: Mapping[str, int]) -> bool:
        """Evict (demote) unlocked L1 leaves until ``demand`` fits, per the stopping rule."""
        arena = self.arena
        if self.config.stop_rule == "unified":  # StopCondition's unified rule, without it
            return self._evict_until(self._fits, demand) is not None
        if arena.can_alloc(demand):
            return True
        stop = StopCondition(self.config.stop_rule, demand, lambda: arena.can_alloc(demand),
                             arena.max_alloc)
        while (leaf := self._l1_queue.peek()) is not None:
            stop.freed(self.evict_l1(leaf))
            assert not leaf.holds(Tier.L1), "an evicted node still holds L1 blocks"
            if stop.satisfied():
                return True
        return arena.can_alloc(demand)

    def take_room(self, demand: Mapping[str, int]
                  ) -> dict[str, tuple[list[int], bytearray]] | None:
        """:meth:`make_room`, then (when holes alone hold ``demand``) its allocation in the same
        step (:meth:`~gpu_arena.Arena.try_alloc`: the packed ids per kind); an empty dict when
        room was made otherwise (the caller allocates), None when there is none. The same
        evictions as :meth:`make_room`."""
        if self.config.stop_rule == "unified":
            return self._evict_until(self.arena.try_alloc, demand)
        got = self.arena.try_alloc(demand)  # StopCondition's loop: the caller allocates
        if got is not None:
            return got
        return {} if self.make_room(demand) else None

    def _fits(self, demand: Mapping[str, int]) -> bool | None:
        """:meth:`~gpu_arena.Arena.can_alloc` as :meth:`_evict_until` reads it (None: no)."""
        return True if self.arena.can_alloc(demand) else None

    def _evict_until(self, fit: Callable[[Mapping[str, int]], _T | None],
                     demand: Mapping[str, int]) -> _T | None:
        """The unified stopping rule: evict the next unlocked L1 leaf until ``fit(demand)`` is
        not None (asked before the first and after each eviction); that answer, or None."""
        got = fit(demand)
        peek = self._l1_queue.peek  # (index.next_victim(L1), without its call)
        while got is None and (leaf := peek()) is not None:
            self.evict_l1(leaf)
            assert not leaf.holds(_L1), "an evicted node still holds L1 blocks"
            got = fit(demand)
        return got if got is not None else fit(demand)  # (a fence may have retired since)

    def evict_l1(self, node: Node) -> dict[str, int]:
        """Demote ``node``'s L1 data (to L2, else L3), free it; blocks freed per kind."""
        if self._lower:
            kept = self.host is not None and self._to_l2(node)
            if not kept and self.disk is not None:
                kept = self.disk.store(self, node, Tier.L1)
            if not kept and self.remote is not None:
                self._to_l3(node, Tier.L1)
        freed = self._release(node, _L1)
        self.ledger.evicted_from_l1(freed)
        self._prune(node, Tier.L1)
        return freed

    def demote_idle(self, cutoff: float) -> int:
        """Demote every unlocked L1 leaf last used at or before ``cutoff`` (monotonic
        seconds), deepest first; how many nodes left L1."""
        demoted = 0
        for node in victims(self.index, Tier.L1, lambda n: n.used_at <= cutoff):
            self.evict_l1(node)
            demoted += 1
        return demoted

    # ------------------------------------------------------------------ L2
    def make_room_l2(self, demand: Mapping[str, int]) -> bool:
        """Evict L2 leaves (to L3 when present) until ``demand`` fits in the host arena."""
        assert self.host is not None
        host = self.host.arena
        while not host.can_alloc(demand):
            leaf = self.index.next_victim(Tier.L2)
            if leaf is None:
                return False
            kept = self.disk is not None and self.disk.store(self, leaf, Tier.L2)
            if not kept and self.remote is not None:
                self._to_l3(leaf, Tier.L2)
            self._release(leaf, Tier.L2)
            self._prune(leaf, Tier.L2)
        return True

    def _to_l2(self, node: Node) -> bool:
        """Copy the node's L1 data that L2 lacks into L2 (making room there). False when L2
        cannot take it."""
        assert self.host is not None
        plan: dict[str, list[int]] = {}
        for kind in self.page_kinds:
            l1, l2 = node.ids(Tier.L1, kind), node.ids(Tier.L2, kind)
            plan[kind] = [j for j, v in enumerate(l1) if v >= 0 and l2[j] < 0]
        if "state" in self.kinds and node.checkpoint(Tier.L1) >= 0 \
                and node.checkpoint(Tier.L2) < 0:
            plan[CHECKPOINT] = [0]
        demand = {k: len(js) for k, js in plan.items() if js}
        if not demand:
            return True
        self.index.lock(node, +1)  # keep L2 eviction off this node's own pages
        try:
            if not self.make_room_l2(demand):
                return False
        finally:
            self.index.lock(node, -1)
        for kind, js in plan.items():
            if js:
                self._copy_down(node, kind, js)
        return True

    def _copy_down(self, node: Node, kind: str, js: list[int]) -> None:
        """Copy entries ``js`` of ``kind`` (page indexes; the checkpoint for "state") L1 -> L2."""
        assert self.host is not None
        host_ids = self.host.arena.alloc(kind, len(js))
        assert host_ids is not None, f"room was made in L2 for {len(js)} {kind} blocks"
        self.host.store(self.arena, kind, [node.entry(Tier.L1, kind, j) for j in js], host_ids)
        self._set(node, Tier.L2, kind, js, host_ids.tolist())
        self.ledger.move("l1_to_l2", len(js) * self.arena.spec(kind).unit_bytes)

    # ------------------------------------------------------------------ L3
    def _to_l3(self, node: Node, tier: int) -> None:
        """Write the node's ``tier`` data that L3 lacks to Redis, pages in order, state last."""
        remote = self.remote
        assert remote is not None
        pages = []  # (page index, kind's rank, kind, bytes): pages in order, kv before swa
        for rank, kind in enumerate(self.page_kinds):
            ids, in_l3 = node.ids(tier, kind), node.ids(Tier.L3, kind)
            js = [j for j, v in enumerate(ids) if v >= 0 and in_l3[j] < 0]
            if js:
                rows, fine = self._rows(node, tier, kind, js)
                pages += [(j, rank, kind, row) for j, row, good in zip(js, rows, fine,
                                                                        strict=True) if good]
        pages.sort(key=lambda page: page[:2])
        entries = [(kind, j) for j, _, kind, _ in pages]
        items = [(remote.key(node.keys[j], kind), row) for j, _, kind, row in pages]
        if "state" in self.kinds and node.checkpoint(tier) >= 0 \
                and node.checkpoint(Tier.L3) < 0:
            state, good = self._rows(node, tier, CHECKPOINT, [0])
            if good[0]:
                entries.append((CHECKPOINT, 0))
                items.append((remote.key(node.keys[-1], CHECKPOINT), state[0]))
        written = remote.put(items)
        direction = f"{TIER_NAMES[Tier(tier)]}_to_l3"
        for (kind, j), ok, (_, payload) in zip(entries, written, items, strict=True):
            if ok:
                self.index.set(node, Tier.L3, kind, j, 1)
                self.ledger.move(direction, len(payload))

    def _rows(self, node: Node, tier: int, kind: str, js: list[int]
              ) -> tuple[np.ndarray, list[bool]]:
        """The node's ``tier`` rows of ``kind`` at page indexes ``js`` and which are good (a
        disk slot that fails verification is not; it is marked absent)."""
        if tier == Tier.DISK:
            assert self.disk is not None
            rows, ok = self.disk.read(kind, [(node, j, 4) for j in js])
            for j, good in zip(js, ok, strict=True):
                if not good:
                    self.index.set(node, Tier.DISK, kind, j, ABSENT)
            return rows, ok
        arena = self.arena if tier == Tier.L1 else self.host.arena  # type: ignore[union-attr]
        ids = [node.entry(tier, kind, j) for j in js]
        return arena.read(kind, ids).cpu().numpy(), [True] * len(js)

    # ------------------------------------------------------------------ release
    def _release(self, node: Node, tier: int) -> dict[str, int]:
        """Free the node's blocks in ``tier`` (L1, L2 or disk); blocks freed per kind."""
        if tier == _DISK:
            assert self.disk is not None
            return self.disk.release(self.index, node)
        arena = self.arena if tier == _L1 else self.host.arena  # type: ignore[union-attr]
        free, kinds = arena.free_owned, self.kinds
        freed: dict[str, int] = {}
        for kind, ids in self.index.clear(node, tier).items():
            if ids:  # (only the layout's kinds hold blocks)
                free(kind, ids)  # the index named them: live, held once
                freed[kind] = len(ids)
            elif kind in kinds:
                freed[kind] = 0
        return freed

    def _prune(self, node: Node, tier: int) -> None:
        """Drop ``node`` and emptied ancestors once no tier holds anything of them (``tier``
        dropped them last: :attr:`on_drop` hears of their page keys)."""
        n: Node | None = node
        index = self.index
        root = index.root
        while (n is not None and n is not root and not n.children and n.lock == 0
               and not any(n._held)):  # (holds_any, without its call)
            parent = n.parent
            on_drop = self.on_drop  # (read each time: a benchmark may wrap it)
            if on_drop is not None:
                on_drop(n.keys, tier)
            index.remove_leaf(n)
            n = parent

    # ------------------------------------------------------------------ promotion
    def wanted(self, path: list[Segment], pages: int
               ) -> tuple[dict[str, list[Entry]], dict[int, int]]:
        """What the prefix of ``pages`` pages needs outside L1, as (node, page index, source
        tier) per kind, and its KV pages per source tier."""
        window = self.layout.swa_window_pages()
        wanted: dict[str, list[Entry]] = {k: [] for k in self.kinds}
        sources = {1: 0, 2: 0, 3: 0, 4: 0} if self.disk is not None else {1: 0, 2: 0, 3: 0}
        if self._all_in_l1(path, pages, window):  # the common hit: nothing to bring up
            sources[1] = pages
            return wanted, sources
        pos = 0
        for seg in path:
            n = seg.node
            for kind in self.page_kinds:
                first = max(0, pages - window - pos) if kind == "swa" else 0
                cols = (n.ids(Tier.L1, kind), n.ids(Tier.L2, kind), n.ids(Tier.L3, kind),
                        n.ids(Tier.DISK, kind))
                out = wanted[kind]
                for j in range(first, min(seg.pages, pages - pos)):
                    tier = 1 if cols[0][j] >= 0 else 2 if cols[1][j] >= 0 else \
                        4 if cols[3][j] >= 0 else 3 if cols[2][j] >= 0 else 0
                    if kind == "kv":
                        sources[tier or 1] += 1
                    if tier >= 2:
                        out.append((n, j, tier))
            pos += seg.pages
        end = path[-1].node if path else None
        if "state" in self.kinds and end is not None:
            tier = _source(end, CHECKPOINT, 0)
            if tier >= 2:
                wanted[CHECKPOINT].append((end, 0, tier))
        return wanted, sources

    def _all_in_l1(self, path: list[Segment], pages: int, window: int) -> bool:
        """Whether L1 holds all a prefix of ``pages`` pages needs (its KV, its SWA window and
        any checkpoint at its end that a lower tier holds)."""
        if not rule.in_l1(path, pages, "kv"):
            return False
        if self._swa and not rule.in_l1(path, pages, "swa", pages - window):
            return False
        return not self._state or not path or _source(path[-1].node, CHECKPOINT, 0) < 2

    def promote(self, path: list[Segment], pages: int, timeout: float | None
                ) -> tuple[str, dict[int, int]]:
        """Bring into L1 what the prefix of ``pages`` pages needs (KV pages, the SWA window
        and the checkpoint at its end) from L2/L3. Returns a status and the KV pages per
        source tier. Status: ``ok``; ``no_room`` (L1 could not make room; nothing loaded);
        ``partial`` (some entries were missing in L3 and are now marked absent there);
        ``unavailable`` (an L3 call failed or timed out; L3 marks are kept for later)."""
        if self._all_in_l1(path, pages, self._window):  # the common hit: nothing to bring up
            return "ok", ({1: pages, 2: 0, 3: 0, 4: 0} if self.disk is not None
                          else {1: pages, 2: 0, 3: 0})
        wanted, sources = self.wanted(path, pages)
        demand = {k: len(v) for k, v in wanted.items() if v}
        if not demand:
            return "ok", sources
        l3 = self._check_l3(wanted, timeout)
        if l3 != "ok":  # Redis evicted some (re-plan) or is unreachable: evict nothing in L1
            return l3, sources
        if not self.make_room(demand):
            return "no_room", sources
        status = "ok"
        for kind, entries in wanted.items():
            if entries:
                outcome = self._load(kind, entries, timeout)
                if outcome != "ok" and status != "unavailable":
                    status = outcome
        return status, sources

    def _check_l3(self, wanted: dict[str, list[Entry]], timeout: float | None) -> str:
        """Probe (one batched EXISTS) the L3 entries a promotion needs before L1 makes room
        for them: ``ok``; ``partial`` when Redis no longer holds some (its own eviction, a TTL;
        they are marked absent); ``unavailable`` when the probe failed (marks kept)."""
        entries = [(kind, e) for kind, es in wanted.items() for e in es if e[2] == 3]
        if self.remote is None or not entries:
            return "ok"
        present = self.remote.exists_each([self.key_of(e, k) for k, e in entries], timeout)
        if present is None:
            return "unavailable"
        gone = [(k, e) for (k, e), ok in zip(entries, present, strict=True) if not ok]
        for kind, (node, j, _) in gone:
            self.index.set(node, Tier.L3, kind, j, ABSENT)
        return "partial" if gone else "ok"

    def _load(self, kind: str, entries: list[Entry], timeout: float | None) -> str:
        """Allocate L1 blocks for ``entries`` and fill them from L2 / L3 ("ok", "partial" or
        "unavailable", as :meth:`promote`)."""
        ids = self.arena.alloc(kind, len(entries))
        assert ids is not None, f"room was made for {len(entries)} {kind} blocks"
        unit = self.arena.spec(kind).unit_bytes
        from_l2 = [i for i, e in enumerate(entries) if e[2] == 2]
        from_l3 = [i for i, e in enumerate(entries) if e[2] == 3]
        ok = [True] * len(entries)
        status = "ok"
        if from_l2:
            assert self.host is not None
            host_ids = [entries[i][0].entry(Tier.L2, kind, entries[i][1]) for i in from_l2]
            self.host.load(self.arena, kind, host_ids, ids[from_l2])
            self.ledger.move("l2_to_l1", len(from_l2) * unit)
        from_disk = [i for i, e in enumerate(entries) if e[2] == 4] if self.disk else []
        if from_disk:
            status = self._load_disk(kind, entries, from_disk, ids, ok)
        if from_l3:
            assert self.remote is not None
            fetched = self.remote.get([self.key_of(entries[i], kind) for i in from_l3], timeout)
            payloads = fetched if fetched is not None else [None] * len(from_l3)
            good = [(i, data) for i, data in zip(from_l3, payloads, strict=True)
                    if data is not None]
            if good:
                rows = torch.from_numpy(np.stack([np.frombuffer(data, np.uint8)
                                                  for _, data in good]))
                self.arena.write(kind, ids[[i for i, _ in good]], rows)
                self.ledger.move("l3_to_l1", len(good) * unit)
            for i, data in zip(from_l3, payloads, strict=True):
                if data is None:
                    ok[i] = False
                    if fetched is not None:  # Redis answered: the value is gone or damaged
                        node, j, _ = entries[i]
                        self.index.set(node, Tier.L3, kind, j, ABSENT)
            if fetched is None:
                status = "unavailable"
            elif len(good) < len(from_l3) and status == "ok":
                status = "partial"
        id_list = ids.tolist()
        bad = [id_list[i] for i in range(len(entries)) if not ok[i]]
        if bad:
            self.arena.free(kind, bad)
        kept = []
        for i, (node, j, _) in enumerate(entries):
            if ok[i]:
                self.index.set(node, Tier.L1, kind, j, id_list[i])
                kept.append(id_list[i])
        self.ledger.adopt(kind, kept)
        return status

    def _load_disk(self, kind: str, entries: list[Entry], which: list[int],
                   ids: torch.Tensor, ok: list[bool]) -> str:
        """Fill L1 blocks ``ids[which]`` from disk; a slot that fails verification is marked
        absent and its entry not ok ("partial"), else "ok"."""
        assert self.disk is not None
        rows, good = self.disk.read(kind, [entries[i] for i in which])
        keep = [k for k, g in enumerate(good) if g]
        if keep:
            self.arena.write(kind, ids[[which[k] for k in keep]],
                             torch.from_numpy(rows[keep]).to(self.arena.device))
            self.ledger.move("disk_to_l1", len(keep) * rows.shape[1])
        for k, g in enumerate(good):
            if not g:
                node, j, _ = entries[which[k]]
                ok[which[k]] = False
                self.index.set(node, Tier.DISK, kind, j, ABSENT)
        return "ok" if len(keep) == len(which) else "partial"

    def key_of(self, entry: Entry, kind: str) -> str:
        """The Redis key of one entry (a page's envelope, or the checkpoint at a node end)."""
        assert self.remote is not None
        node, j, _ = entry
        return self.remote.key(node.keys[-1] if kind == CHECKPOINT else node.keys[j], kind)

    # ------------------------------------------------------------------ write policies
    def backup(self, node: Node) -> None:
        """Write-through: copy the node's L1 data to every lower tier that lacks it."""
        if self.host is not None:
            self._to_l2(node)
        if self.disk is not None:
            self.disk.store(self, node, Tier.L1)
        if self.remote is not None:
            self._to_l3(node, Tier.L1)

    def _set(self, node: Node, tier: int, kind: str, js: list[int], values: list[int]) -> None:
        if kind == CHECKPOINT:
            self.index.set(node, tier, kind, 0, values[0])
        else:
            self.index.set_many(node, tier, kind, js, values)


def _source(node: Node, kind: str, j: int) -> int:
    """The nearest tier holding an entry (0: nowhere)."""
    for tier in CHAIN:
        if node.entry(tier, kind, j) >= 0:
            return int(tier)
    return 0
