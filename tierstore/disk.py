"""The store's side of the local disk tier: moving a node's envelopes to and from
:class:`disk_tier.DiskTier`, and re-linking what a previous run left into the prefix index.

A slot records its page key, the previous page's key and the page's depth, so after a restart
the pages re-link into chains from the first page down without any tokens: a prompt's pages
hash to the same keys again and walk the rebuilt tree. A page whose parent is not on disk
cannot start a prefix match and its slots are freed; a checkpoint ends a node.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from disk_tier import DiskTier, Recovered, SlotMeta
from remote_tier.mac import Mac
from tierstore.radix import ABSENT, CHECKPOINT, Node, RadixIndex, Tier
from tierstore.settings import mac_secret

if TYPE_CHECKING:
    from gpu_arena import Arena
    from host_tier import HostTier
    from tierstore.config import StoreConfig
    from tierstore.ledger import Ledger
    from tierstore.remote import RemoteBridge

log = logging.getLogger(__name__)


class Mover(Protocol):
    """What the disk bridge uses of its mover (:class:`tierstore.movement.Mover`), declared
    here so that this module imports nothing of it."""

    arena: Arena
    host: HostTier | None
    remote: RemoteBridge | None
    index: RadixIndex
    ledger: Ledger
    page_kinds: tuple[str, ...]

    def _to_l3(self, node: Node, tier: int) -> None: ...
    def _release(self, node: Node, tier: int) -> dict[str, int]: ...
    def _prune(self, node: Node, tier: int) -> None: ...


class DiskBridge:
    """The disk tier of one store (``units``: envelope bytes per kind)."""

    def __init__(self, config: StoreConfig, units: Mapping[str, int], layout_fp: str) -> None:
        assert config.disk_path is not None
        secret = config.disk_mac_key if config.disk_mac_key is not None else mac_secret()
        self.tier = DiskTier(config.disk_path, config.disk_size_bytes, units, layout_fp,
                             Mac(secret), io_threads=config.disk_io_threads,
                             direct=config.disk_direct)
        self.kinds = tuple(units)

    def close(self) -> None:
        self.tier.close()

    # ------------------------------------------------------------------ demotion
    def store(self, mover: Mover, node: Node, tier: int) -> bool:
        """Copy the node's ``tier`` (L1 or L2) entries that the disk lacks onto it, making
        room by demoting disk leaves (to L3 when present). False when the disk cannot take
        them (then nothing of them is on disk)."""
        index = mover.index
        plan: dict[str, list[int]] = {}
        for kind in mover.page_kinds:
            src, have = node.ids(tier, kind), node.ids(Tier.DISK, kind)
            plan[kind] = [j for j, v in enumerate(src) if v >= 0 and have[j] < 0]
        if CHECKPOINT in self.kinds and node.checkpoint(tier) >= 0 \
                and node.checkpoint(Tier.DISK) < 0:
            plan[CHECKPOINT] = [0]
        demand = {k: len(js) for k, js in plan.items() if js}
        if not demand:
            return True
        index.lock(node, +1)  # keep disk eviction off this node's own pages
        try:
            if not self.make_room(mover, demand):
                return False
        finally:
            index.lock(node, -1)
        arena = mover.arena if tier == Tier.L1 else mover.host.arena  # type: ignore[union-attr]
        direction = "l1_to_disk" if tier == Tier.L1 else "l2_to_disk"
        kept = True
        for kind, js in plan.items():
            if not js:
                continue
            slots = self.tier.alloc(kind, len(js))
            assert slots is not None, f"room was made on disk for {len(js)} {kind} slots"
            ids = [node.entry(tier, kind, j) for j in js]
            rows = arena.read(kind, ids).cpu().numpy()
            metas = [self.meta(node, kind, j) for j in js]
            ok = self.tier.write(kind, slots, rows, metas)
            failed = [s for s, good in zip(slots, ok, strict=True) if not good]
            if failed:
                self.tier.free(kind, failed)
                kept = False
            done = [(j, s) for j, s, good in zip(js, slots, ok, strict=True) if good]
            for j, s in done:
                index.set(node, Tier.DISK, kind, j, s)
            mover.ledger.move(direction, len(done) * rows.shape[1])
        return kept

    def make_room(self, mover: Mover, demand: Mapping[str, int]) -> bool:
        """Evict disk leaves (to L3 when present) until ``demand`` slots are free."""
        tier = self.tier
        while not tier.can_alloc(demand):
            leaf = mover.index.next_victim(Tier.DISK)
            if leaf is None:
                return False
            if mover.remote is not None:
                mover._to_l3(leaf, Tier.DISK)
            mover._release(leaf, Tier.DISK)
            mover._prune(leaf, Tier.DISK)
        return True

    def release(self, index: RadixIndex, node: Node) -> dict[str, int]:
        """Free the node's disk slots; slots freed per kind."""
        removed = index.clear(node, Tier.DISK)
        for kind, slots in removed.items():
            if slots:
                self.tier.free(kind, slots)
        return {k: len(v) for k, v in removed.items() if k in self.kinds}

    @staticmethod
    def meta(node: Node, kind: str, j: int) -> SlotMeta:
        """What a slot records of page ``j`` of ``node`` (the checkpoint: its last page)."""
        if kind == CHECKPOINT:
            j = len(node.keys) - 1
        if j > 0:
            parent = node.keys[j - 1]
        else:
            up = node.parent
            parent = up.keys[-1] if up is not None and up.keys else b""
        return SlotMeta(node.keys[j], parent, node.depth + j)

    # ------------------------------------------------------------------ promotion
    def read(self, kind: str, entries: Sequence[tuple[Node, int, int]]
             ) -> tuple[np.ndarray, list[bool]]:
        """Rows of ``entries`` (node, page index, _) from disk and whether each verified;
        a slot that did not is freed and marked absent."""
        slots = [n.entry(Tier.DISK, kind, j) for n, j, _ in entries]
        keys = [(n.keys[-1] if kind == CHECKPOINT else n.keys[j]) for n, j, _ in entries]
        return self.tier.read(kind, slots, keys)

    # ------------------------------------------------------------------ restart
    def rebuild(self, index: RadixIndex, recovered: Sequence[Recovered]) -> int:
        """Hang what a previous run left on disk into ``index`` (empty) as disk-resident;
        pages re-linked. Slots that cannot be linked are freed."""
        by_kind: dict[str, dict[bytes, Recovered]] = {k: {} for k in ("kv", "swa", "state")}
        for rec in recovered:
            by_kind[rec.kind][rec.meta.key] = rec
        pages = by_kind["kv"]
        children: dict[bytes, list[bytes]] = {}
        for key, rec in pages.items():
            children.setdefault(rec.meta.parent if rec.meta.depth else b"", []).append(key)
        linked: set[tuple[str, int]] = set()
        stack: list[tuple[Node, bytes]] = [(index.root, k) for k in children.get(b"", [])
                                           if pages[k].meta.depth == 0]
        while stack:
            parent, first = stack.pop()
            run = [first]  # extend while the chain is unary and no checkpoint ends it
            while (len(kids := children.get(run[-1], [])) == 1
                   and run[-1] not in by_kind["state"]
                   and pages[kids[0]].meta.depth == pages[run[-1]].meta.depth + 1):
                run.append(kids[0])
            entries = {"kv": [pages[k].slot for k in run]}
            if "swa" in self.kinds:
                entries["swa"] = [by_kind["swa"][k].slot if k in by_kind["swa"] else ABSENT
                                  for k in run]
            node = index.extend(parent, run, entries, Tier.DISK)
            linked.update(("kv", pages[k].slot) for k in run)
            linked.update(("swa", s) for s in entries.get("swa", []) if s >= 0)
            state = by_kind["state"].get(run[-1])
            if state is not None and CHECKPOINT in self.kinds:
                index.set(node, Tier.DISK, CHECKPOINT, 0, state.slot)
                linked.add((CHECKPOINT, state.slot))
            depth = pages[run[-1]].meta.depth
            stack += [(node, k) for k in children.get(run[-1], [])
                      if pages[k].meta.depth == depth + 1]
        stray: dict[str, list[int]] = {}
        for rec in recovered:
            if (rec.kind, rec.slot) not in linked:
                stray.setdefault(rec.kind, []).append(rec.slot)
        for kind, slots in stray.items():
            self.tier.free(kind, slots)
        if recovered:
            log.info("disk tier: %d pages re-linked from a previous run, %d slots freed "
                     "(no parent on disk)", len(linked), sum(map(len, stray.values())))
        return len(linked)


__all__ = ["DiskBridge"]
