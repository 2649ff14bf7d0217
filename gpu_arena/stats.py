"""Typed snapshots of an arena's occupancy."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PoolStats:
    """One pool: live, reusable-hole and pending bytes, and its band in bytes."""

    unit_bytes: int
    anchor: str
    live_blocks: int
    live_bytes: int
    hole_bytes: int
    pending_bytes: int
    band_start: int
    band_end: int
    moves: int
    allocated: int = 0  # blocks ever allocated (moves / allocated: the cost of sliding bands)


@dataclass(frozen=True)
class ArenaStats:
    """The whole arena: free bytes between bands (gap), moves and compactions so far."""

    capacity_bytes: int
    gap_bytes: int
    moves: int
    compactions: int
    pending_fences: int
    pools: dict[str, PoolStats]
    moved_bytes: int = 0  # bytes copied by compaction so far
    allocated_bytes: int = 0  # bytes ever allocated

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
