"""L3 discovery and background prefetch, for the mover.

Discovery learns pages that Redis holds beyond what the index knows (written by another
instance, or before a restart) and hangs them into the index as L3-resident. With the
``best_effort`` prefetch policy both the probe and the fetch run in the background, and
:meth:`Prefetcher.pump` files what has arrived on the next call into the store.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from tierstore.radix import CHECKPOINT, Node, Segment, Tier

if TYPE_CHECKING:
    from gpu_arena import Arena
    from host_tier import HostTier
    from tierstore.layout import ModelLayout
    from tierstore.ledger import Ledger
    from tierstore.radix import RadixIndex
    from tierstore.remote import Probe, RemoteBridge

log = logging.getLogger(__name__)

# (node, page index — ignored for the checkpoint —, source tier) of one entry to move
Entry = tuple[Node, int, int]


class MoverParts(Protocol):
    """What the prefetcher uses of its mover (:class:`tierstore.movement.Mover`), declared
    here, below the mover, so that this module imports nothing of it."""

    arena: Arena
    host: HostTier | None
    remote: RemoteBridge | None
    index: RadixIndex
    layout: ModelLayout
    ledger: Ledger
    kinds: tuple[str, ...]

    def wanted(self, path: list[Segment], pages: int
               ) -> tuple[dict[str, list[Entry]], dict[int, int]]: ...
    def key_of(self, entry: Entry, kind: str) -> str: ...
    def make_room(self, demand: Mapping[str, int]) -> bool: ...
    def make_room_l2(self, demand: Mapping[str, int]) -> bool: ...


class Prefetcher:
    """The background half of the mover's L3 work (needs the mover's remote tier)."""

    def __init__(self, mover: MoverParts) -> None:
        assert mover.remote is not None
        self.mover = mover
        self.remote = mover.remote
        self.index = mover.index
        # Background fetches: (page keys of the prefix, Redis keys, future of payloads).
        self._pending: list[tuple[list[bytes], list[str], Future[Any]]] = []
        # Background probes, by the first page the index did not know.
        self._probing: dict[bytes, tuple[list[bytes], int, Future[Probe]]] = {}

    @property
    def pending(self) -> int:
        """Background probes and fetches not yet filed."""
        return len(self._pending) + len(self._probing)

    # ------------------------------------------------------------------ discovery
    def discover(self, keys: list[bytes], timeout: float | None) -> None:
        """Probe L3 for the pages of ``keys`` after those the index knows; wait for it."""
        known = sum(seg.pages for seg in self.index.walk(keys))
        if known < len(keys):
            probe = self.remote.probe(keys[known:], self._probe_kinds(), timeout)
            if probe is not None:
                self._learn(keys, known, probe)

    def discover_later(self, keys: list[bytes]) -> None:
        """:meth:`discover` without waiting: the probe runs in the background and
        :meth:`pump` files what it found, so a later match can prefetch those pages."""
        known = sum(seg.pages for seg in self.index.walk(keys))
        if known == len(keys) or keys[known] in self._probing:
            return
        self._probing[keys[known]] = (keys, known,
                                      self.remote.submit_probe(keys[known:], self._probe_kinds()))

    def _probe_kinds(self) -> list[str]:
        return [k for k in ("swa", CHECKPOINT) if k in self.mover.kinds]

    def _learn(self, keys: list[bytes], known: int, probe: Probe) -> None:
        """Hang the pages a probe found after the first ``known`` pages of ``keys`` into the
        index as L3-resident: one node per checkpoint, so each sits at a node's end."""
        found = probe.found
        if found == 0:
            return
        rest = keys[known : known + found]
        swa = probe.present.get("swa", [False] * found)
        hybrid = self.mover.layout.state is not None
        ends = [found]
        if hybrid:
            ends = [i + 1 for i, ok in enumerate(probe.present[CHECKPOINT]) if ok]
            if not ends:
                return  # KV without any checkpoint cannot serve a hybrid match
        parent = self.index.node_ending_at(self.index.walk(keys[:known]))
        start = 0
        for end in ends:
            n = end - start
            entries = {"kv": [1] * n, "swa": [1 if ok else -1 for ok in swa[start:end]]}
            parent = self.index.extend(parent, rest[start:end], entries, Tier.L3)
            if hybrid:
                self.index.set(parent, Tier.L3, CHECKPOINT, 0, 1)
            start = end

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, keys: list[bytes], pages: int) -> None:
        """Start fetching, in the background, what L3 holds of the prefix of ``pages`` pages;
        :meth:`pump` files it into L2 (or L1) when it has arrived."""
        mover = self.mover
        wanted, _ = mover.wanted(self.index.walk(keys[:pages]), pages)
        redis_keys = [mover.key_of(e, kind) for kind, entries in wanted.items()
                      for e in entries if e[2] == 3]
        if redis_keys:
            self._pending.append((keys[:pages], redis_keys, self.remote.submit_get(redis_keys)))

    def pump(self) -> None:
        """File probes and prefetches that have finished; drop failed ones (a missed chance:
        the data stays in L3)."""
        if self._pending:
            self._pump_fetches()
        if self._probing:
            self._pump_probes()

    def _pump_fetches(self) -> None:
        still = []
        for keys, redis_keys, future in self._pending:
            if not future.done():
                still.append((keys, redis_keys, future))
                continue
            try:
                payloads = future.result()
            except Exception as exc:
                log.info("prefetch of %d envelopes failed: %s", len(redis_keys), exc)
                continue
            arrived = {k: v for k, v in zip(redis_keys, payloads, strict=True) if v is not None}
            self._file(keys, arrived)
        self._pending = still

    def _pump_probes(self) -> None:
        for first, (keys, known, future) in list(self._probing.items()):
            if not future.done():
                continue
            del self._probing[first]
            try:
                probe = future.result()
            except Exception as exc:
                log.info("L3 discovery probe failed: %s", exc)
                continue
            if sum(seg.pages for seg in self.index.walk(keys)) == known:
                self._learn(keys, known, probe)

    def _file(self, keys: list[bytes], arrived: dict[str, memoryview]) -> None:
        """Write prefetched envelopes into L2 (L1 without a host tier) and record them."""
        mover = self.mover
        path = self.index.walk(keys)
        if sum(seg.pages for seg in path) < len(keys):
            return  # the prefix left the index meanwhile
        wanted, _ = mover.wanted(path, len(keys))
        tier = Tier.L2 if mover.host is not None else Tier.L1
        arena = mover.host.arena if mover.host is not None else mover.arena
        node = path[-1].node
        self.index.lock(node, +1)
        try:
            for kind, entries in wanted.items():
                entries = [e for e in entries if e[2] == 3 and mover.key_of(e, kind) in arrived]
                if not entries:
                    continue
                room = mover.make_room_l2({kind: len(entries)}) if tier == Tier.L2 \
                    else mover.make_room({kind: len(entries)})
                ids = arena.alloc(kind, len(entries)) if room else None
                if ids is None:
                    return
                rows = np.stack([np.frombuffer(arrived[mover.key_of(e, kind)], np.uint8)
                                 for e in entries])
                arena.write(kind, ids, torch.from_numpy(rows).to(arena.device))
                blocks = ids.tolist()
                for (n, j, _), block in zip(entries, blocks, strict=True):
                    self.index.set(n, tier, kind, j, block)
                if tier == Tier.L1:
                    mover.ledger.adopt(kind, blocks)
                mover.ledger.move("l3_to_l2" if tier == Tier.L2 else "l3_to_l1", rows.nbytes)
        finally:
            self.index.lock(node, -1)
