"""Compaction: moving blocks inside the arena's buffer to close holes and slide bands.

The planner (:mod:`gpu_arena.planner`) says where each band must end up; these functions move
the blocks in the way (one batched copy per pool) and relink their ids. Each visits only the
slots that leave or join a band and the holes it fills, never a whole band.
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from gpu_arena.planner import Plan
from gpu_arena.pool import Pool


def execute(buf: torch.Tensor, low: Pool | None, floating: Pool | None, high: Pool | None,
            plan: Plan) -> None:
    """Compact and slide bands to the plan's targets (low, then high, then float)."""
    if low is not None:
        relocate(buf, low, 0, min(plan.low_slots, low.hi))
    if high is not None:
        relocate(buf, high, max(high.max_slots - plan.high_slots, high.lo), high.max_slots)
    if floating is not None and plan.float_band is not None:
        relocate(buf, floating, *plan.float_band)


def relocate(buf: torch.Tensor, p: Pool, lo: int, hi: int) -> None:
    """Move every live block outside slots ``[lo, hi)`` into free slots inside it, and make
    ``[lo, hi)`` (trimmed) the band. Visits only the slots that leave the band, the gap slots
    that join it and the holes it fills, so the cost follows the blocks moved (a slide by
    ``d`` slots moves at most ``d`` blocks), not the band's size."""
    old_lo, old_hi = p.lo, p.hi
    leaving = [p.live_in(old_lo, min(lo, old_hi)), p.live_in(max(hi, old_lo), old_hi)]
    outside = np.concatenate(leaving)
    k = outside.size
    if k:
        dst = _destinations(p, lo, hi, old_lo, old_hi, k)
        move(buf, p, torch.from_numpy(outside), torch.from_numpy(dst))
    p.lo, p.hi = lo, hi  # every occupied slot is inside now; trim to the occupied hull
    p.trim()
    # Gap slots that joined the band and stayed free are holes now.
    p.add_free_slots(p.lo, min(old_lo, p.hi))
    p.add_free_slots(max(old_hi, p.lo), p.hi)


def _destinations(p: Pool, lo: int, hi: int, old_lo: int, old_hi: int, k: int) -> np.ndarray:
    """``k`` free slots of ``[lo, hi)`` nearest the anchor: gap slots joining the band (free by
    the band invariant) and holes of the old band from the hole heap."""
    below = np.arange(lo, min(old_lo, hi), dtype=np.int64)
    above = np.arange(max(old_hi, lo), hi, dtype=np.int64)
    if p.anchor == "high":
        near, far = above[::-1], below[::-1]
    else:
        near, far = below, above
    parts = [near[:k]]
    left = k - parts[0].size
    if left:
        holes = p.holes_within(max(lo, old_lo), min(hi, old_hi), left)
        parts.append(np.asarray(holes, dtype=np.int64))
        left -= len(holes)
    if left:
        parts.append(far[:left])
        left -= parts[-1].size
    assert left == 0, f"pool {p.name}: {k} blocks to move, {k - left} free slots"
    return np.concatenate(parts)


def pack(buf: torch.Tensor, p: Pool, budget: int) -> int:
    """Move up to ``budget`` movable blocks from the inner edge into holes nearer the anchor;
    returns how many moved."""
    holes = p.holes()
    if holes.numel() == 0:
        return 0
    band = torch.arange(p.lo, p.hi)
    movable = band[(p.owner[band] >= 0) & (p.writers[band] == 0)]
    if p.anchor != "high":
        movable = movable.flip(0)  # farthest from the anchor first
    k = min(holes.numel(), movable.numel(), budget)
    holes, movable = holes[:k], movable[:k]
    worth = holes < movable if p.anchor != "high" else holes > movable
    k = int(worth.sum())  # holes run toward the edge, blocks away from it: a prefix holds
    if k:
        move(buf, p, movable[:k], holes[:k])
    p.trim()
    return k


def move(buf: torch.Tensor, p: Pool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy blocks ``src`` -> ``dst`` (one batched copy) and relink their ids."""
    device = buf.device
    if device.type != "meta":  # an accounting-only arena has no bytes to move
        # Live blocks move into free slots of the same pool: no source overlaps a
        # destination, so the copy needs no staging.
        kernels.strided_copy(buf, buf, src.to(device), dst.to(device), nbytes=p.unit,
                             src_stride=p.unit, dst_stride=p.unit, src_offset=p.origin,
                             dst_offset=p.origin, overlap=False)
    p.relink(src, dst)
