"""Compaction planning: where every band must end up for a joint request to fit.

Pure bookkeeping over the pools' tables (no bytes move here). A plan exists exactly when the
request fits after compacting every pool and sliding the floating band: ``can_alloc`` asks for
a plan, ``alloc`` executes one only when holes and the adjacent gap are not enough.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpu_arena.pool import Pool


@dataclass(frozen=True)
class Plan:
    """Band targets after a full compaction that makes room for a joint request."""

    low_slots: int  # low band becomes [0, low_slots)
    high_slots: int  # high band becomes [max_slots - high_slots, max_slots)
    float_band: tuple[int, int] | None  # float band moves into [start, end) slots


def plan(low: Pool | None, floating: Pool | None, high: Pool | None, capacity: int,
         request: Mapping[str, int]) -> Plan | None:
    """Band targets that fit ``request`` ({pool: blocks}) after compacting every pool, or
    ``None``. Fenced slots stay where they are; the floating band starts as near its current
    place as it can (fewest moves)."""
    targets = _targets(low, floating, high, capacity, request)
    return None if targets is None else Plan(*targets)


def fits(low: Pool | None, floating: Pool | None, high: Pool | None, capacity: int,
         request: Mapping[str, int]) -> bool:
    """Whether :func:`plan` finds a plan (without building it)."""
    return _targets(low, floating, high, capacity, request) is not None


def _targets(low: Pool | None, floating: Pool | None, high: Pool | None, capacity: int,
             request: Mapping[str, int]) -> tuple[int, int, tuple[int, int] | None] | None:
    low_slots = high_slots = size = 0  # band slots per pool after compaction, with the request
    if low is not None:
        low_slots = _grown(low, request)
        if low_slots > low.cap:
            return None
    if floating is not None:
        size = _grown(floating, request)
        if size > floating.cap:
            return None
    if high is not None:
        high_slots = _grown(high, request)
        if high_slots > high.cap:
            return None
    low_end = low_slots * low.unit if low else 0
    high_start = capacity
    if high:
        high_start = high.origin + (high.max_slots - high_slots) * high.unit
    if low_end > high_start:
        return None
    f = floating
    if f is None or (f.num_live + f.num_pending + request.get(f.name, 0)) == 0:
        return low_slots, high_slots, None
    s_min = ceil_div(low_end - f.origin, f.unit)
    s_max = (high_start - f.origin) // f.unit - size
    pins = f.pins()
    if pins is not None:
        s_min, s_max = max(s_min, pins[1] + 1 - size), min(s_max, pins[0])
    if s_min > s_max:
        return None
    start = min(max(f.lo, s_min), s_max)
    return low_slots, high_slots, (start, start + size)


def _grown(p: Pool, request: Mapping[str, int]) -> int:
    """Slots ``p``'s band needs after full compaction with its part of ``request`` added."""
    occupied = p.num_live + p.num_pending
    if not p.fenced_refs:  # compacts to its occupied slots: no holes left to absorb the request
        return occupied + request.get(p.name, 0)
    extent = p.min_extent()  # fenced slots stay where they are
    return extent + max(0, request.get(p.name, 0) - (extent - occupied))


def ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def limits(pools: Sequence[Pool], p: Pool, capacity: int) -> tuple[int, int]:
    """Bytes ``[lower, upper)`` between the non-empty neighbouring bands of ``p`` (``pools``
    in band order)."""
    lower, upper = 0, capacity
    seen_p = False
    for q in pools:
        if q is p:
            seen_p = True
        elif q.hi > q.lo:
            if seen_p:
                upper = min(upper, q.start)
            else:
                lower = max(lower, q.end)
    return lower, upper


def float_start(low: Pool | None, high: Pool | None, first_fit: int, last_fit: int,
                need: int) -> int:
    """Where an empty floating band starts in the free slots ``[first_fit, last_fit)``:
    against the end that no pool grows from (so filling the arena moves nothing), else
    in the middle (a neighbour reaching it slides it by what that neighbour needs)."""
    if low is None:
        return first_fit
    if high is None:
        return last_fit - need
    return first_fit + (last_fit - first_fit - need) // 2
