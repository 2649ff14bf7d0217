"""Per-pool bookkeeping: the location table, the slot owners, fence counts and the band."""

from __future__ import annotations

import numpy as np
import torch

from gpu_arena.slots import SlotLoops, slot_loops
from gpu_arena.spec import ANCHORS, IntegrityError, PoolSpec

_LONG = torch.long


class Pool:
    """The tables of one sub-pool. Slot ``s`` lives at byte ``origin + s * unit_bytes``; the band
    is the slot range ``[lo, hi)``. Pure bookkeeping on CPU tensors: no bytes are copied here.

    ``loc[vid]`` is the slot of a live virtual id (-1 when the id is free); ``owner[slot]`` is the
    live id in a slot (-1 when free). ``readers``/``writers`` count pending fences per slot; a free
    slot with a fence is *pending*: it still belongs to the band and is not reused.
    """

    # Stale entries the hole heap may hold beyond twice its holes before a sweep drops them
    # (tests lower it to sweep often). Small: stale entries far from the anchor never surface
    # (a slot at the band's inner edge, trimmed off and taken back through the gap, leaves one
    # each time), and every take sorts or pops past them; a sweep stays amortised O(1) per
    # stale entry, as at least half of what it reads is stale.
    sweep_slack = 16
    # Ids per call up to which binding and releasing run per-id loops (SlotLoops), and past
    # which they use numpy: a numpy call costs ~1 µs before it does anything, a loop item ~50 ns
    # in Python (a few ns compiled). A request's 24 blocks are below it, a bulk fill far above.
    small_batch = 64
    # The per-id loops: compiled where built (None), or as set (a test builds pools of both).
    compiled: bool | None = None

    def __init__(self, spec: PoolSpec, origin: int, max_slots: int, lo: int) -> None:
        self.spec = spec
        self.name = spec.name
        self.unit = spec.unit_bytes
        self.anchor = spec.anchor
        self.origin = origin
        self.max_slots = max_slots
        # A fixed split caps the band: at most this many slots (live, pending or holes).
        self.cap = max_slots if spec.max_bytes is None else min(max_slots,
                                                                  spec.max_bytes // spec.unit_bytes)
        self.lo = lo
        self.hi = lo
        self.loc = torch.full((max_slots,), -1, dtype=_LONG)
        self.owner = torch.full((max_slots,), -1, dtype=_LONG)
        self.readers = torch.zeros(max_slots, dtype=torch.int32)
        self.writers = torch.zeros(max_slots, dtype=torch.int32)
        # Free virtual ids as a stack: popping from the top hands out 0, 1, 2, ... first.
        self.free_ids = torch.arange(max_slots - 1, -1, -1, dtype=_LONG)
        # Zero-copy numpy views of the tables: a few-element update costs ~1 µs through numpy
        # and several through torch, and the hot paths (alloc, free) are a few elements.
        self.loc_np = self.loc.numpy()
        self.owner_np = self.owner.numpy()
        self._readers_np = self.readers.numpy()
        self._writers_np = self.writers.numpy()
        self._free_np = self.free_ids.numpy()
        # Slots that may be holes, nearest the anchor first (keys: sign * slot), kept by the
        # loops with the few-id hot paths (a request's alloc and free): finding n holes costs
        # about n entries, not a scan of the band.
        self.sign = -1 if self.anchor == "high" else 1  # hole-heap keys are sign * slot
        self.mode = ANCHORS.index(self.anchor)  # which ends trim shrinks (SlotLoops.trim)
        # (Public: the arena's steady-state alloc and free call them directly.)
        self.loops: SlotLoops = slot_loops(self.loc_np, self.owner_np, self._readers_np,
                                            self._writers_np, self._free_np, sign=self.sign,
                                            compiled=self.compiled)
        self.num_free_ids = max_slots
        self.num_live = 0
        self.num_pending = 0
        self.moves = 0
        self.allocated = 0  # blocks ever bound to an id (for moves per allocated block)
        # Slots visited by this class's scans (relocation, pins); :attr:`visited` adds the
        # loops' (hole-heap entries, band edges).
        self._scanned = 0
        # Ids whose `loc` entry changed since a device mirror last synced (None: not logging).
        self.changed: list[torch.Tensor] | None = None
        self.num_changed = 0
        self.fenced_refs = 0  # (slot, fence) pairs pending: 0 lets hot paths skip fence checks

    # ----------------------------------------------------------------- queries
    @property
    def start(self) -> int:
        """First byte of the band."""
        return self.origin + self.lo * self.unit

    @property
    def end(self) -> int:
        """One past the last byte of the band."""
        return self.origin + self.hi * self.unit

    @property
    def visited(self) -> int:
        """Slots visited by scans (band edges, relocation, hole-heap entries and sweeps): tests
        bound it per allocation, so no hot path scans the whole band."""
        return self._scanned + self.loops.visited

    @property
    def num_holes(self) -> int:
        """Free slots inside the band that no fence holds (reusable now)."""
        return self.hi - self.lo - self.num_live - self.num_pending

    def fenced(self, lo: int, hi: int) -> torch.Tensor:
        """Mask over slots ``[lo, hi)``: some fence is pending on the slot."""
        return (self.readers[lo:hi] > 0) | (self.writers[lo:hi] > 0)

    def occupied(self, lo: int, hi: int) -> torch.Tensor:
        """Mask over slots ``[lo, hi)``: live or pending (not reusable)."""
        return torch.from_numpy(self._occupied_np(lo, hi))

    def holes(self) -> torch.Tensor:
        """Every reusable slot of the band, nearest the anchor first (a scan of the band)."""
        if self.num_holes == 0:
            return torch.empty(0, dtype=_LONG)
        idx = torch.from_numpy(np.flatnonzero(~self._occupied_np(self.lo, self.hi)) + self.lo)
        return idx.flip(0) if self.anchor == "high" else idx

    def take_holes(self, n: int) -> list[int]:
        """The ``n`` (at most :attr:`num_holes`) reusable slots nearest the anchor, in that
        order — the first ``n`` of :meth:`holes` — found from the hole heap without scanning
        the band, and taken off it: the caller binds ids to them (:meth:`bind`)."""
        assert n <= self.num_holes, f"pool {self.name}: {n} holes wanted, {self.num_holes} exist"
        if n == 0:
            return []
        found = self.holes_within(self.lo, self.hi, n)
        assert len(found) == n, f"pool {self.name}: hole heap found {len(found)} of {n} holes"
        return found

    def holes_within(self, lo: int, hi: int, n: int) -> list[int]:
        """Up to ``n`` reusable slots of ``[lo, hi)`` (inside the band) nearest the anchor,
        taken off the hole heap. Entries met on the way that are stale or outside ``[lo, hi)``
        are dropped: the caller re-cuts the band to ``[lo, hi)`` or it already is that."""
        return self.loops.take(lo, hi, n, self.fenced_refs != 0)

    def _add_holes(self, slots: list[int] | np.ndarray) -> None:
        """Remember free ``slots`` as possible holes (validated when they surface), sweeping
        the hole heap first when stale entries outnumber the holes (these about to join them):
        amortised O(1) per stale entry."""
        loops = self.loops
        if len(loops) > 2 * (self.num_holes + len(slots)) + self.sweep_slack:
            loops.sweep(self.lo, self.hi, self.fenced_refs != 0)
        loops.add(slots.tolist() if isinstance(slots, np.ndarray) else slots)

    def live_in(self, lo: int, hi: int) -> np.ndarray:
        """Slots of ``[lo, hi)`` holding a live block, in slot order (visits those slots)."""
        if hi <= lo:
            return np.empty(0, dtype=np.int64)
        self._scanned += hi - lo
        return np.flatnonzero(self.owner_np[lo:hi] >= 0) + lo

    def add_free_slots(self, lo: int, hi: int) -> None:
        """Remember the free slots of ``[lo, hi)`` (just joined the band) as holes."""
        if hi > lo:
            self._add_holes((np.flatnonzero(~self._occupied_np(lo, hi)) + lo).tolist())

    def pins(self) -> tuple[int, int] | None:
        """Lowest and highest slot holding a fence (such slots cannot move), or None."""
        if self.hi == self.lo or not self.fenced_refs:
            return None
        self._scanned += self.hi - self.lo
        idx = torch.nonzero(self.fenced(self.lo, self.hi)).flatten()
        if idx.numel() == 0:
            return None
        return int(idx[0]) + self.lo, int(idx[-1]) + self.lo

    def min_extent(self) -> int:
        """Slots the band needs after full compaction: every occupied slot, and every fenced slot
        where it is (fenced blocks do not move)."""
        occupied = self.num_live + self.num_pending
        pins = self.pins()
        if pins is None:
            return occupied
        if self.anchor == "low":
            return max(occupied, pins[1] + 1)
        if self.anchor == "high":
            return max(occupied, self.max_slots - pins[0])
        return max(occupied, pins[1] - pins[0] + 1)

    # --------------------------------------------------------------- updates
    def bind(self, slots: list[int]) -> list[int]:
        """Bind fresh virtual ids to ``slots`` (free, reusable) and return the ids. Per-id loops
        (:class:`SlotLoops`): for a few ids (:attr:`small_batch`); :meth:`bind_array` for many."""
        n = len(slots)
        assert n <= self.num_free_ids, f"pool {self.name}: {n} ids wanted, {self.num_free_ids} free"
        ids = self.loops.bind(slots, self.num_free_ids)
        self.bound(ids)
        return ids

    def bind_array(self, slots: np.ndarray) -> np.ndarray:
        """:meth:`bind` through numpy, for many ids."""
        n = slots.size
        assert n <= self.num_free_ids, f"pool {self.name}: {n} ids wanted, {self.num_free_ids} free"
        top = self.num_free_ids
        ids = self._free_np[top - n : top][::-1].copy()
        self.loc_np[ids] = slots
        self.owner_np[slots] = ids
        self.bound(ids)
        return ids

    def bound(self, ids: list[int] | np.ndarray) -> None:
        """Count ``ids`` as just bound (off the free stack, live) and log them."""
        n = len(ids)
        self.num_free_ids -= n
        self.num_live += n
        self.allocated += n
        if self.changed is not None:
            self._log(ids)

    def free_few(self, ids: list[int]) -> None:
        """Unbind live ``ids`` (a few, as a list; :meth:`release_array` for many): their slots
        are free now (pending where fenced) and join the hole heap, and when an end of the band
        was freed the band is trimmed. Per-id loops (:class:`SlotLoops`), one call."""
        n = len(ids)
        if not n:
            return
        got = self.loops.free(ids, self.num_free_ids, self.fenced_refs != 0, self.lo, self.hi,
                               self.num_live + self.num_pending, self.sweep_slack, self.mode)
        self.num_free_ids += n
        self.num_live -= n
        if got is not None:  # a fence holds some, or the band was trimmed
            pending, self.lo, self.hi = got
            self.num_pending += pending
        if self.changed is not None:
            self._log(ids)

    def release_array(self, ids: np.ndarray) -> np.ndarray:
        """Unbind many live ids through numpy (:meth:`free_few` without the trim: the caller
        trims); returns their slots."""
        n = ids.size
        slots = self.loc_np[ids]
        self.owner_np[slots] = -1
        self.loc_np[ids] = -1
        self._free_np[self.num_free_ids : self.num_free_ids + n] = ids[::-1]
        self.num_free_ids += n
        self.num_live -= n
        if self.changed is not None:
            self._log(ids)
        if self.fenced_refs:
            self.num_pending += int(self._fenced_at(torch.from_numpy(slots)).sum())
        self._add_holes(slots)
        return slots

    def take_ids(self, slots: torch.Tensor | np.ndarray) -> torch.Tensor:
        """:meth:`bind_array` for a tensor or array of slots; the ids as a tensor."""
        return torch.from_numpy(self.bind_array(_np(slots)))

    def release_ids(self, ids: torch.Tensor | np.ndarray) -> np.ndarray:
        """:meth:`release_array` for a tensor or array of ids."""
        return self.release_array(_np(ids))

    def relink(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Record that the blocks in ``src`` slots now live in ``dst`` slots."""
        ids = self.owner[src]
        self.owner[dst] = ids
        self.owner[src] = -1
        self.loc[ids] = dst
        if self.fenced_refs:
            self.num_pending += int(self._fenced_at(src).sum())
        self.moves += src.numel()
        self._log(ids)
        self._add_holes(src.tolist())

    def start_log(self) -> None:
        """Start (or restart) logging which ids' ``loc`` entries change, for :meth:`patch`."""
        self.changed = []
        self.num_changed = 0

    def patch(self, mirror: torch.Tensor) -> None:
        """Bring ``mirror`` (a copy of ``loc`` as it was at the last :meth:`start_log` or
        ``patch``, on any device) up to date, copying only the changed entries; enqueued on the
        mirror's current stream."""
        assert self.changed is not None, f"pool {self.name}: patch without start_log"
        if self.num_changed >= self.max_slots:
            mirror.copy_(self.loc)
        elif self.changed:
            ids = torch.cat(self.changed)
            mirror.index_copy_(0, ids.to(mirror.device), self.loc[ids].to(mirror.device))
        self.start_log()

    def _log(self, ids: torch.Tensor | np.ndarray | list[int]) -> None:
        """Remember ``ids`` for the device mirror. Past a quarter of the table a full copy is
        cheaper than the scatter, so the log collapses to ``num_changed = max_slots``."""
        if self.changed is None or self.num_changed >= self.max_slots:
            return
        self.num_changed += len(ids)
        if self.num_changed * 4 >= self.max_slots:
            self.changed.clear()
            self.num_changed = self.max_slots
        elif isinstance(ids, torch.Tensor):  # a copy: callers own (and may change) their ids
            self.changed.append(ids.clone())
        else:
            self.changed.append(torch.tensor(ids, dtype=_LONG))

    def add_fence(self, slots: torch.Tensor, write: bool, delta: int) -> None:
        """Count a fence on (``delta=1``) or off (``delta=-1``) ``slots``."""
        counts = self.writers if write else self.readers
        before = self._fenced_at(slots) & (self.owner[slots] < 0)
        counts.index_add_(0, slots, torch.full_like(slots, delta, dtype=torch.int32))
        self.fenced_refs += delta * slots.numel()
        after = self._fenced_at(slots) & (self.owner[slots] < 0)
        self.num_pending += int(after.sum()) - int(before.sum())
        if delta < 0:  # a retired fence may leave holes behind
            self._add_holes(slots[before & ~after].tolist())

    def _fenced_at(self, slots: torch.Tensor) -> torch.Tensor:
        if not self.fenced_refs:
            return torch.zeros(slots.shape, dtype=torch.bool)
        return (self.readers[slots] > 0) | (self.writers[slots] > 0)

    def trim(self) -> None:
        """Shrink the band from its inner edge(s) past slots that are free and unfenced.
        Scans outward from each edge in growing chunks, so the usual case costs one small op."""
        self.lo, self.hi = self.loops.trim(self.lo, self.hi, self.fenced_refs != 0, self.mode)

    def _occupied_np(self, lo: int, hi: int) -> np.ndarray:
        """:meth:`occupied` as a numpy mask (cheap for the few-slot scans of :meth:`trim`)."""
        self._scanned += max(0, hi - lo)
        live = self.owner_np[lo:hi] >= 0
        if self.fenced_refs:
            live |= (self._readers_np[lo:hi] > 0) | (self._writers_np[lo:hi] > 0)
        return live

    # ------------------------------------------------------------- integrity
    def check(self) -> None:
        """Raise IntegrityError if the tables disagree with each other or with the band."""
        name = self.name
        live_ids = torch.nonzero(self.loc >= 0).flatten()
        live_slots = torch.nonzero(self.owner >= 0).flatten()
        _require(live_ids.numel() == self.num_live == live_slots.numel(),
                 f"{name}: live count {self.num_live}, ids {live_ids.numel()}, "
                 f"slots {live_slots.numel()}")
        _require(bool((self.owner[self.loc[live_ids]] == live_ids).all()),
                 f"{name}: loc and owner disagree")
        _require(0 <= self.lo <= self.hi <= self.max_slots, f"{name}: band [{self.lo},{self.hi})")
        outside = torch.ones(self.max_slots, dtype=torch.bool)
        outside[self.lo : self.hi] = False
        _require(not bool((self.owner[outside] >= 0).any()), f"{name}: live slot outside band")
        _require(not bool(self.fenced(0, self.max_slots)[outside].any()),
                 f"{name}: fenced slot outside band")
        _require(bool((self.readers >= 0).all() and (self.writers >= 0).all()),
                 f"{name}: negative fence count")
        pending = int((self.fenced(0, self.max_slots) & (self.owner < 0)).sum())
        _require(pending == self.num_pending, f"{name}: pending {self.num_pending} != {pending}")
        refs = int(self.readers.sum() + self.writers.sum())
        _require(refs == self.fenced_refs, f"{name}: {self.fenced_refs} fence refs != {refs}")
        free = self.free_ids[: self.num_free_ids]
        everything = torch.cat([free, live_ids]).sort().values
        _require(bool(torch.equal(everything, torch.arange(self.max_slots))),
                 f"{name}: free ids + live ids are not all ids exactly once")
        missing = set(self.holes().tolist()) - {self.sign * k for k in self.loops.entries()}
        _require(not missing, f"{name}: {len(missing)} holes are not in the hole heap")
        if self.anchor == "low":
            _require(self.lo == 0, f"{name}: low band starts at slot {self.lo}")
        if self.anchor == "high":
            _require(self.hi == self.max_slots, f"{name}: high band ends at slot {self.hi}")


def _np(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """``ids`` as an int64 numpy array (a view of a CPU long tensor)."""
    if isinstance(ids, torch.Tensor):
        return ids.to("cpu", _LONG).numpy()
    return np.asarray(ids, dtype=np.int64)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
