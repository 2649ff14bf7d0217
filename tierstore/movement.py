"""Demotion and promotion of cached envelopes between L1 (device arena), L2 (host arena) and
L3 (Redis), mixed into :class:`~tierstore.store.TierStore`.

Policy, not mechanism: which node leaves a tier (the eviction policy, leaf-first per tier, never
a locked node) and where its bytes go. Evicting from L1 copies what is not yet in L2 down to L2
(making room there by demoting L2 leaves to L3), or straight to L3 without a host tier; evicting
from L2 writes what L3 lacks to L3. A copy kept in a lower tier stays there after promotion, so
demoting the same page again costs nothing. A node is dropped once no tier holds any of it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierstore.eviction import StopCondition, victims
from tierstore.radix import Node, Segment

if TYPE_CHECKING:
    from gpu_arena import Arena
    from host_tier import HostTier
    from tierstore.eviction import EvictionPolicy
    from tierstore.layout import ModelLayout
    from tierstore.radix import RadixIndex
    from tierstore.remote import RemoteBridge

log = logging.getLogger(__name__)

PAGE_KINDS = ("kv", "swa")
DIRECTIONS = ("l1_to_l2", "l1_to_l3", "l2_to_l3", "l2_to_l1", "l3_to_l1", "l3_to_l2")


class TierMovement:
    """Requires (set by TierStore): ``arena``, ``host``, ``remote``, ``index``, ``policy``,
    ``layout``, ``kinds``, ``_owned`` (L1 ids the cache owns, per kind), ``_evicted``,
    ``_evictions``, ``_moved`` (bytes per direction), ``config``."""

    arena: Arena
    host: HostTier | None
    remote: RemoteBridge | None
    index: RadixIndex
    policy: EvictionPolicy
    layout: ModelLayout
    kinds: tuple[str, ...]
    _owned: dict[str, set[int]]
    _evicted: dict[str, int]
    _evictions: int
    _moved: dict[str, int]
    _pending: list[tuple[list[bytes], list[str], Any]]  # background L3 prefetches

    # ------------------------------------------------------------------ L1 room
    def _make_room(self, demand: Mapping[str, int]) -> bool:
        """Evict (demote) unlocked L1 leaves until ``demand`` fits, per the stopping rule."""
        if self.arena.can_alloc(demand):
            return True
        stop = StopCondition(self.config.stop_rule, demand,  # type: ignore[attr-defined]
                             lambda: self.arena.can_alloc(demand), self.arena.max_alloc)
        for leaf in victims(self.index, self.policy, lambda n: n.holds(1)):
            stop.freed(self._evict_l1(leaf))
            if stop.satisfied():
                return True
        return self.arena.can_alloc(demand)

    def _evict_l1(self, node: Node) -> dict[str, int]:
        """Demote ``node``'s L1 data (to L2, else L3), free it; blocks freed per kind."""
        kept = self.host is not None and self._to_l2(node)
        if not kept and self.remote is not None:
            self._to_l3(node, 1)
        freed = self._release(node, 1)
        self._evictions += 1
        self._prune(node)
        return freed

    # ------------------------------------------------------------------ L2
    def _make_room_l2(self, demand: Mapping[str, int]) -> bool:
        assert self.host is not None
        host = self.host.arena
        if host.can_alloc(demand):
            return True
        for leaf in victims(self.index, self.policy, lambda n: n.holds(2)):
            self._evict_l2(leaf)
            if host.can_alloc(demand):
                return True
        return host.can_alloc(demand)

    def _evict_l2(self, node: Node) -> None:
        if self.remote is not None:
            self._to_l3(node, 2)
        self._release(node, 2)
        self._prune(node)

    def _to_l2(self, node: Node) -> bool:
        """Copy the node's L1 data that L2 lacks into L2 (making room there). False when L2
        cannot take it."""
        assert self.host is not None
        plan = {k: [j for j, v in enumerate(node.col(k, 1)) if v >= 0 and node.col(k, 2)[j] < 0]
                for k in PAGE_KINDS if k in self.kinds}
        if "state" in self.kinds and node.state >= 0 and node.state2 < 0:
            plan["state"] = [-1]  # the checkpoint (index -1, as in _entry)
        demand = {k: len(js) for k, js in plan.items() if js}
        if not demand:
            return True
        self.index.lock(node, +1)  # keep L2 eviction off this node's own pages
        try:
            if not self._make_room_l2(demand):
                return False
        finally:
            self.index.lock(node, -1)
        for kind, js in plan.items():
            if js:
                self._copy_down(node, kind, js)
        return True

    def _copy_down(self, node: Node, kind: str, js: list[int]) -> None:
        """Copy entries ``js`` of ``kind`` (page indexes; -1: the checkpoint) L1 -> L2."""
        assert self.host is not None
        host_ids = self.host.arena.alloc(kind, len(js))
        assert host_ids is not None, f"room was made in L2 for {len(js)} {kind} blocks"
        self.host.store(self.arena, kind, [_entry((node, j, 1), kind, 1) for j in js], host_ids)
        for j, h in zip(js, host_ids.tolist(), strict=True):
            _set_entry((node, j, 2), kind, 2, h)
        self._moved["l1_to_l2"] += len(js) * self.arena.spec(kind).unit_bytes

    # ------------------------------------------------------------------ L3
    def _to_l3(self, node: Node, tier: int) -> None:
        """Write the node's ``tier`` data that L3 lacks to Redis, pages in order, state last."""
        assert self.remote is not None
        arena = self.arena if tier == 1 else self.host.arena  # type: ignore[union-attr]
        entries: list[tuple[str, int]] = []  # (kind, page index; -1 for the checkpoint)
        items = []
        for kind in PAGE_KINDS:
            if kind not in self.kinds:
                continue
            col, col3 = node.col(kind, tier), node.col(kind, 3)
            js = [j for j, v in enumerate(col) if v >= 0 and col3[j] < 0]
            if js:
                rows = arena.read(kind, [col[j] for j in js]).cpu().numpy()
                entries += [(kind, j) for j in js]
                items += [(self.remote.key(node.keys[j], kind), rows[i])
                          for i, j in enumerate(js)]
        if "state" in self.kinds and node.checkpoint(tier) >= 0 and node.state3 < 0:
            entries.append(("state", -1))
            items.append((self.remote.key(node.keys[-1], "state"),
                          arena.read("state", [node.checkpoint(tier)]).cpu().numpy()[0]))
        order = sorted(range(len(items)), key=lambda i: (entries[i][1] < 0, entries[i][1]))
        written = self.remote.put([items[i] for i in order])
        direction = "l1_to_l3" if tier == 1 else "l2_to_l3"
        for i, ok in zip(order, written, strict=True):
            if not ok:
                continue
            kind, j = entries[i]
            if j < 0:
                node.state3 = 1
            else:
                node.col(kind, 3)[j] = 1
            self._moved[direction] += len(items[i][1])

    # ------------------------------------------------------------------ release
    def _release(self, node: Node, tier: int) -> dict[str, int]:
        """Free the node's blocks in ``tier`` (1 or 2); blocks freed per kind."""
        arena = self.arena if tier == 1 else self.host.arena  # type: ignore[union-attr]
        freed = {}
        for kind in PAGE_KINDS:
            if kind not in self.kinds:
                continue
            col = node.col(kind, tier)
            ids = [v for v in col if v >= 0]
            if ids:
                arena.free(kind, ids)
                col[:] = [-1] * len(col)
                if tier == 1:
                    self._owned[kind].difference_update(ids)
            freed[kind] = len(ids)
        if "state" in self.kinds:
            sid = node.checkpoint(tier)
            if sid >= 0:
                arena.free("state", [sid])
                node.set_checkpoint(tier, -1)
            freed["state"] = int(sid >= 0)
            if tier == 1 and sid >= 0:
                self._owned["state"].discard(sid)
        if tier == 1:
            for kind, n in freed.items():
                self._evicted[kind] += n
        return freed

    def _prune(self, node: Node) -> None:
        """Drop ``node`` and emptied ancestors once no tier holds anything of them."""
        n: Node | None = node
        while (n is not None and n is not self.index.root and not n.children and n.lock == 0
               and not n.holds_any()):
            parent = n.parent
            self.index.remove_leaf(n)
            n = parent

    # ------------------------------------------------------------------ promotion
    def _wanted(self, path: list[Segment], pages: int
                ) -> tuple[dict[str, list[tuple[Node, int, int]]], dict[int, int]]:
        """What the prefix of ``pages`` pages needs outside L1, as (node, page index or -1
        for the checkpoint, source tier) per kind, and its KV pages per source tier."""
        window = self.layout.swa_window_pages()
        wanted: dict[str, list[tuple[Node, int, int]]] = {k: [] for k in self.kinds}
        sources = {1: 0, 2: 0, 3: 0}
        pos = 0
        for seg in path:
            n = seg.node
            for j in range(seg.pages):
                p = pos + j
                if p >= pages:
                    break
                for kind in PAGE_KINDS:
                    if kind not in self.kinds or (kind == "swa" and p < pages - window):
                        continue
                    tier = _source(n.col(kind, 1)[j], n.col(kind, 2)[j], n.col(kind, 3)[j])
                    if kind == "kv":
                        sources[tier or 1] += 1
                    if tier in (2, 3):
                        wanted[kind].append((n, j, tier))
            pos += seg.pages
        end = path[-1].node if path else None
        if "state" in self.kinds and end is not None:
            tier = _source(end.state, end.state2, end.state3)
            if tier in (2, 3):
                wanted["state"].append((end, -1, tier))
        return wanted, sources

    def _promote(self, path: list[Segment], pages: int, timeout: float | None
                 ) -> tuple[str, dict[int, int]]:
        """Bring into L1 what the prefix of ``pages`` pages needs (KV pages, the SWA window
        and the checkpoint at its end) from L2/L3. Returns a status and the KV pages per
        source tier. Status: ``ok``; ``no_room`` (L1 could not make room; nothing loaded);
        ``partial`` (some entries were missing in L3 and are now marked absent there);
        ``unavailable`` (an L3 call failed or timed out; L3 marks are kept for later)."""
        wanted, sources = self._wanted(path, pages)
        demand = {k: len(v) for k, v in wanted.items() if v}
        if not demand:
            return "ok", sources
        l3 = self._check_l3(wanted, timeout)
        if l3 != "ok":  # Redis evicted some (re-plan) or is unreachable: evict nothing in L1
            return l3, sources
        if not self._make_room(demand):
            return "no_room", sources
        status = "ok"
        for kind, entries in wanted.items():
            if entries:
                outcome = self._load(kind, entries, timeout)
                if outcome != "ok" and status != "unavailable":
                    status = outcome
        return status, sources

    def _check_l3(self, wanted: dict[str, list[tuple[Node, int, int]]], timeout: float | None
                  ) -> str:
        """Probe (one batched EXISTS) the L3 entries a promotion needs before L1 makes room
        for them: ``ok``; ``partial`` when Redis no longer holds some (its own eviction, a TTL;
        they are marked absent); ``unavailable`` when the probe failed (marks kept)."""
        entries = [(kind, e) for kind, es in wanted.items() for e in es if e[2] == 3]
        if self.remote is None or not entries:
            return "ok"
        present = self.remote.exists_each(
            [self.remote.key(_page_key(e), k) for k, e in entries], timeout)
        if present is None:
            return "unavailable"
        gone = [(k, e) for (k, e), ok in zip(entries, present, strict=True) if not ok]
        for kind, entry in gone:
            _set_entry(entry, kind, 3, -1)
        return "partial" if gone else "ok"

    def _load(self, kind: str, entries: list[tuple[Node, int, int]], timeout: float | None
              ) -> str:
        """Allocate L1 blocks for ``entries`` and fill them from L2 / L3 ("ok", "partial" or
        "unavailable", as :meth:`_promote`)."""
        ids = self.arena.alloc(kind, len(entries))
        assert ids is not None, f"room was made for {len(entries)} {kind} blocks"
        unit = self.arena.spec(kind).unit_bytes
        from_l2 = [i for i, e in enumerate(entries) if e[2] == 2]
        from_l3 = [i for i, e in enumerate(entries) if e[2] == 3]
        ok = [True] * len(entries)
        status = "ok"
        if from_l2:
            assert self.host is not None
            host_ids = [_entry(entries[i], kind, 2) for i in from_l2]
            self.host.load(self.arena, kind, host_ids, ids[from_l2])
            self._moved["l2_to_l1"] += len(from_l2) * unit
        if from_l3:
            assert self.remote is not None
            keys = [self.remote.key(_page_key(entries[i]), kind) for i in from_l3]
            fetched = self.remote.get(keys, timeout)
            payloads = fetched if fetched is not None else [None] * len(keys)
            good = [(i, data) for i, data in zip(from_l3, payloads, strict=True)
                    if data is not None]
            if good:
                rows = torch.from_numpy(np.stack([np.frombuffer(data, np.uint8)
                                                  for _, data in good]))
                self.arena.write(kind, ids[[i for i, _ in good]], rows)
                self._moved["l3_to_l1"] += len(good) * unit
            for i, data in zip(from_l3, payloads, strict=True):
                if data is None:
                    ok[i] = False
                    if fetched is not None:  # Redis answered: the value is gone or damaged
                        _set_entry(entries[i], kind, 3, -1)
            if fetched is None:
                status = "unavailable"
            elif len(good) < len(from_l3):
                status = "partial"
        bad = [int(ids[i]) for i in range(len(entries)) if not ok[i]]
        if bad:
            self.arena.free(kind, bad)
        for i, entry in enumerate(entries):
            if ok[i]:
                _set_entry(entry, kind, 1, int(ids[i]))
                self._owned[kind].add(int(ids[i]))
        return status

    # ------------------------------------------------------------------ prefetch
    def _prefetch(self, keys: list[bytes], pages: int) -> None:
        """Start fetching, in the background, what L3 holds of the prefix of ``pages`` pages
        (``best_effort``); :meth:`_pump` files it into L2 (or L1) when it has arrived."""
        assert self.remote is not None
        path = self.index.walk(keys[:pages])
        wanted, _ = self._wanted(path, pages)
        redis_keys = [self.remote.key(_page_key(e), kind)
                      for kind, entries in wanted.items() for e in entries if e[2] == 3]
        if redis_keys:
            self._pending.append((keys[:pages], redis_keys, self.remote.submit_get(redis_keys)))

    def _pump(self) -> None:
        """File prefetches that have arrived; drop failed ones (the data stays in L3)."""
        if not self._pending:
            return
        still = []
        for keys, redis_keys, future in self._pending:
            if not future.done():
                still.append((keys, redis_keys, future))
                continue
            try:
                payloads = future.result()
            except Exception as exc:  # a failed prefetch is only a missed chance
                log.info("prefetch of %d envelopes failed: %s", len(redis_keys), exc)
                continue
            arrived = {k: v for k, v in zip(redis_keys, payloads, strict=True) if v is not None}
            self._file_prefetch(keys, arrived)
        self._pending = still

    def _file_prefetch(self, keys: list[bytes], arrived: dict[str, memoryview]) -> None:
        assert self.remote is not None
        path = self.index.walk(keys)
        if sum(seg.pages for seg in path) < len(keys):
            return  # the prefix left the index meanwhile
        wanted, _ = self._wanted(path, len(keys))
        tier = 2 if self.host is not None else 1
        arena = self.host.arena if self.host is not None else self.arena
        node = path[-1].node
        self.index.lock(node, +1)
        try:
            for kind, entries in wanted.items():
                entries = [e for e in entries if e[2] == 3
                           and self.remote.key(_page_key(e), kind) in arrived]
                if not entries:
                    continue
                room = self._make_room_l2({kind: len(entries)}) if tier == 2 \
                    else self._make_room({kind: len(entries)})
                ids = arena.alloc(kind, len(entries)) if room else None
                if ids is None:
                    return
                rows = np.stack([np.frombuffer(arrived[self.remote.key(_page_key(e), kind)],
                                               np.uint8) for e in entries])
                arena.write(kind, ids, torch.from_numpy(rows).to(arena.device))
                for entry, block in zip(entries, ids.tolist(), strict=True):
                    _set_entry(entry, kind, tier, block)
                    if tier == 1:
                        self._owned[kind].add(block)
                self._moved["l3_to_l2" if tier == 2 else "l3_to_l1"] += rows.nbytes
        finally:
            self.index.lock(node, -1)

    # ------------------------------------------------------------------ write policies
    def _backup(self, node: Node) -> None:
        """Write-through: copy the node's L1 data to every lower tier that lacks it."""
        if self.host is not None:
            self._to_l2(node)
        if self.remote is not None:
            self._to_l3(node, 1)


def _source(l1: int, l2: int, l3: int) -> int | None:
    """The nearest tier holding an entry (None: nowhere)."""
    return 1 if l1 >= 0 else 2 if l2 >= 0 else 3 if l3 >= 0 else None


def _entry(entry: tuple[Node, int, int], kind: str, tier: int) -> int:
    node, j, _ = entry
    return node.checkpoint(tier) if j < 0 else node.col(kind, tier)[j]


def _set_entry(entry: tuple[Node, int, int], kind: str, tier: int, value: int) -> None:
    node, j, _ = entry
    if j < 0:
        node.set_checkpoint(tier, value)
    else:
        node.col(kind, tier)[j] = value


def _page_key(entry: tuple[Node, int, int]) -> bytes:
    node, j, _ = entry
    return node.keys[-1] if j < 0 else node.keys[j]
