"""An insert given envelope bytes instead of block ids: the bytes are copied into fresh L1
blocks first (evicting as needed), so a shortfall changes nothing. Off the engine's path
(engines insert the ids :meth:`TierStore.allocate` handed out)."""

from __future__ import annotations

import torch

from gpu_arena import Arena
from tierstore import checks
from tierstore.ledger import Ledger
from tierstore.movement import Mover
from tierstore.radix import CHECKPOINT, RadixIndex, Segment


def insert_bytes(index: RadixIndex, mover: Mover, arena: Arena, ledger: Ledger,
                 given: dict[str, torch.Tensor | None], lists: dict[str, list[int] | None],
                 keys: list[bytes], path: list[Segment], n_pages: int
                 ) -> list[Segment] | None:
    """Copy the envelope bytes an insert was given into fresh L1 blocks (evicting as needed
    through ``mover``) and put their ids in ``lists``; the walk of ``keys`` again, or None
    (nothing changed) when they do not fit."""
    need = checks.bytes_demand(given, path, n_pages)
    demand = {k: sum(m) for k, m in need.items() if any(m)}
    if demand:
        anchor = index.node_ending_at(path) if path else None
        if anchor is not None:
            index.lock(anchor, +1)
        try:
            if not mover.make_room(demand):
                return None
        finally:
            if anchor is not None:
                index.lock(anchor, -1)
        path = index.walk(keys)  # the anchor was locked: the path is intact
    for kind, mask in need.items():
        data = given[kind]
        assert data is not None
        ids = _store_bytes(arena, ledger, kind, data, mask)
        lists[kind] = ids if kind != CHECKPOINT or ids[0] >= 0 else None
    return path


def _store_bytes(arena: Arena, ledger: Ledger, kind: str, data: torch.Tensor,
                 need: list[bool]) -> list[int]:
    """Write the rows of ``data`` that ``need`` marks into fresh L1 blocks (handed to the
    insert); ids per row (-1 where the page already has an L1 copy)."""
    out = [-1] * len(data)
    count = sum(need)
    if count:
        fresh = arena.alloc(kind, count)
        assert fresh is not None, f"{kind}: room was made for {count} blocks"
        rows = data if count == len(need) else data[torch.tensor(need, dtype=torch.bool)]
        arena.write(kind, fresh, rows.to(arena.device))
        fresh_ids = iter(fresh.tolist())
        out = [next(fresh_ids) if n else -1 for n in need]
        ledger.hand_out(kind, (i for i in out if i >= 0))
    return out
