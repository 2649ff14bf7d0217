"""Pool specifications and the arena's errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tierstore.errors import InternalError, UsageError

Anchor = Literal["low", "high", "float"]
ANCHORS: tuple[Anchor, ...] = ("low", "float", "high")  # band order from byte 0 upwards
ALIGN = 16  # bytes: every unit and the capacity are multiples, so copies can be vector-wide


class ArenaError(UsageError):
    """Caller misuse of an arena: unknown pool, foreign or double-freed id, wrong shape."""


class IntegrityError(InternalError):
    """An arena's internal state broke an invariant (a bug, never caller misuse)."""


@dataclass(frozen=True)
class PoolSpec:
    """One sub-pool: blocks of ``unit_bytes`` in a band anchored at the low end, the high end, or
    floating between them. An arena holds at most one pool per anchor. ``max_bytes`` caps the
    band (so one arena can also model a fixed split, for comparison)."""

    name: str
    unit_bytes: int
    anchor: Anchor = "float"
    max_bytes: int | None = None  # a cap on the band (a fixed split); None: no cap

    def __post_init__(self) -> None:
        if not self.name:
            raise ArenaError("pool name must not be empty")
        if self.unit_bytes <= 0 or self.unit_bytes % ALIGN:
            raise ArenaError(
                f"pool {self.name!r}: unit_bytes must be a positive multiple of {ALIGN}, "
                f"got {self.unit_bytes}"
            )
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ArenaError(f"pool {self.name!r}: max_bytes must be >= 0, got {self.max_bytes}")
        if self.anchor not in ANCHORS:
            raise ArenaError(
                f"pool {self.name!r}: anchor must be one of {ANCHORS}, got {self.anchor!r}"
            )


def check_pools(capacity_bytes: int, pools: Sequence[PoolSpec]) -> None:
    """Raise ArenaError unless an arena of ``capacity_bytes`` can hold ``pools``: an aligned
    capacity, one or more pools with unique names and anchors, each unit within the capacity."""
    if capacity_bytes <= 0 or capacity_bytes % ALIGN:
        raise ArenaError(
            f"capacity_bytes must be a positive multiple of {ALIGN}, got {capacity_bytes}"
        )
    names = [p.name for p in pools]
    if not pools or len(set(names)) != len(names):
        raise ArenaError(f"need at least one pool and unique names, got {names}")
    anchors = [p.anchor for p in pools]
    if len(set(anchors)) != len(anchors):
        pairs = dict(zip(names, anchors, strict=True))
        raise ArenaError(f"at most one pool per anchor, got {pairs}")
    for p in pools:
        if p.unit_bytes > capacity_bytes:
            raise ArenaError(
                f"pool {p.name!r}: unit of {p.unit_bytes} B exceeds capacity {capacity_bytes} B"
            )
