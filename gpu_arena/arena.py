"""The unified arena: one byte buffer shared by up to three pools of different block sizes."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

import numpy as np
import torch

import kernels
from gpu_arena import compaction
from gpu_arena.fence import Fence, FenceMode, Fences
from gpu_arena.ids import IdsLike, checked_ids
from gpu_arena.planner import Plan, ceil_div, fits, float_start, limits, plan
from gpu_arena.pool import Pool
from gpu_arena.slots import packed
from gpu_arena.spec import ANCHORS, ArenaError, IntegrityError, PoolSpec, check_pools
from gpu_arena.stats import ArenaStats, PoolStats
from gpu_arena.views import Views

log = logging.getLogger(__name__)


class Arena:
    """One contiguous ``uint8`` buffer holding the blocks of up to three pools.

    The ``low`` pool grows up from byte 0, the ``high`` pool grows down from the top, the
    ``float`` pool sits between them and slides; free bytes collect in the gaps and belong to
    whichever pool needs them. Callers hold virtual ids; :meth:`resolve` maps them to slots.
    Holes left by :meth:`free` stay until an allocation needs the space, then blocks are moved
    (one batched copy per pool) to close them. Fenced blocks never move and fenced free slots are
    not reused until the fence retires. Not thread-safe, except :meth:`Fence.complete`.
    """

    def __init__(
        self,
        capacity_bytes: int,
        pools: Sequence[PoolSpec],
        device: str | torch.device = "cpu",
        *,
        pin_memory: bool = False,
        buffer: torch.Tensor | None = None,
    ) -> None:
        """``device="meta"`` builds an accounting-only arena (no bytes; reads and writes are
        shape-only), for capacity studies at real sizes. ``buffer`` (``uint8``,
        ``[capacity_bytes]``, on ``device``) is memory to use instead of a fresh zeroed
        allocation, e.g. a shared-memory segment; the arena never frees it."""
        check_pools(capacity_bytes, pools)
        self.capacity_bytes = capacity_bytes
        self.device = torch.device(device)
        if buffer is not None:
            if buffer.dtype != torch.uint8 or tuple(buffer.shape) != (capacity_bytes,) or \
                    buffer.device != self.device or not buffer.is_contiguous():
                raise ArenaError(f"buffer must be contiguous uint8 [{capacity_bytes}] on "
                                 f"{self.device}, got {buffer.dtype} {tuple(buffer.shape)} on "
                                 f"{buffer.device}")
            self._buf = buffer
        else:
            self._buf = torch.zeros(capacity_bytes, dtype=torch.uint8, device=self.device,
                                    pin_memory=pin_memory and self.device.type == "cpu")
        self._pools: dict[str, Pool] = {}
        for spec in sorted(pools, key=lambda s: ANCHORS.index(s.anchor)):
            origin = capacity_bytes % spec.unit_bytes if spec.anchor == "high" else 0
            max_slots = (capacity_bytes - origin) // spec.unit_bytes
            lo = max_slots if spec.anchor == "high" else 0
            self._pools[spec.name] = Pool(spec, origin, max_slots, lo)
        self._pool_list = list(self._pools.values())
        by_anchor = {p.anchor: p for p in self._pools.values()}
        self._low, self._float, self._high = (by_anchor.get(a) for a in ("low", "float", "high"))
        self._fences = Fences(self._pools)
        self._pending = self._fences.pending  # the hot paths test it (a list: no call)
        self._views = Views(self._buf)
        self.compactions = 0

    # ================================================================ public API
    @property
    def buffer(self) -> torch.Tensor:
        """The raw byte buffer (for copies between tiers; bookkeeping stays with the arena)."""
        return self._buf

    def pool_names(self) -> list[str]:
        """Pool names in band order (low, float, high)."""
        return list(self._pools)

    def spec(self, pool: str) -> PoolSpec:
        """The spec a pool was created with."""
        return self._pool(pool).spec

    def num_live(self, pool: str) -> int:
        """Live blocks in a pool."""
        return self._pool(pool).num_live

    def alloc(self, pool: str, n: int) -> torch.Tensor | None:
        """Allocate ``n`` blocks; return their virtual ids, or ``None`` when even a full
        compaction cannot make room (nothing changes then). May move other blocks."""
        p = self._pool(pool)
        slots = self._free_slots(p, _count(pool, n))
        if slots is None:
            return None
        if isinstance(slots, list):
            return torch.tensor(p.bind(slots), dtype=torch.long)
        return torch.from_numpy(p.bind_array(slots))

    def alloc_ids(self, pool: str, n: int) -> list[int] | None:
        """:meth:`alloc` with the ids as a list (no tensor to build and convert back). Same
        checks, same effect, same ``None``."""
        got = self.alloc_packed(pool, n)
        return None if got is None else got[0]

    def alloc_packed(self, pool: str, n: int) -> tuple[list[int], bytearray] | None:
        """:meth:`alloc_ids`, the ids also packed as native int64 bytes (the store's path:
        ``torch.frombuffer`` makes its tensor of them without converting the ints again).
        Same checks, same effect, same ``None``."""
        p = self._pools.get(pool)
        if p is None:
            p = self._pool(pool)  # raises, naming the pools
        if type(n) is not int or n < 0:
            n = _count(pool, n)
        if self._pending:
            self._fences.retire()
        if n <= p.hi - p.lo - p.num_live - p.num_pending:  # the steady state: reuse holes
            if n <= p.small_batch:  # take holes and bind ids to them in one compiled call
                got = p.loops.take_bind(p.lo, p.hi, n, p.fenced_refs != 0, p.num_free_ids)
                assert got is not None, f"pool {p.name}: hole heap found fewer than {n} holes"
                p.bound(got[0])
                return got
            ids = p.bind_array(np.asarray(p.take_holes(n), dtype=np.int64))
            return ids.tolist(), bytearray(ids)
        slots = self._grow(p, n)
        if slots is None:
            return None
        if isinstance(slots, list):
            bound = p.bind(slots)
            return bound, packed(bound)
        ids = p.bind_array(slots)
        return ids.tolist(), bytearray(ids)

    def can_alloc(self, request: Mapping[str, int]) -> bool:
        """Whether allocating all of ``request`` ({pool: n}) would succeed, counting the gap and
        every byte compaction can reclaim in any pool. Changes nothing."""
        pools = self._pools
        fenced = bool(self._pending)
        short = False
        for name, n in request.items():  # one pass, as the store asks twice per request
            p = pools.get(name)
            if p is None:
                p = self._pool(name)  # raises, naming the pools
            if type(n) is not int or n < 0:
                _count(name, n)  # raises unless an int subclass
            if not fenced and n > p.hi - p.lo - p.num_live - p.num_pending:
                short = True
        if fenced:  # retired only once the request is known good: bad input changes nothing
            self._fences.retire()
            short = any(n > pools[name].num_holes for name, n in request.items())
        # holes alone hold it: no plan needed (a plan would find the same)
        return not short or self._fits(request)

    def _fits(self, request: Mapping[str, int]) -> bool:
        """Whether a plan places ``request`` (checked) past the holes. Bands never overlap and
        each keeps at least its occupied slots plus its part of the request, so past the
        capacity no plan exists: a full cache's steady state (it evicts) answers unplanned."""
        need = 0
        for p in self._pool_list:
            need += (p.num_live + p.num_pending + request.get(p.name, 0)) * p.unit
        return need <= self.capacity_bytes and fits(self._low, self._float, self._high,
                                                    self.capacity_bytes, request)

    def try_alloc(self, request: Mapping[str, int]
                  ) -> dict[str, tuple[list[int], bytearray]] | None:
        """:meth:`can_alloc`, then, when holes alone hold ``request`` (a few blocks a pool, no
        fence pending), :meth:`alloc_packed` of each pool in its order: those results; ``{}``
        when room exists otherwise (the caller allocates), None when not. Same errors."""
        pools = self._pools
        short = odd = False
        for name, n in request.items():  # (can_alloc's one pass)
            p = pools.get(name)
            if p is None:
                p = self._pool(name)  # raises, naming the pools
            if type(n) is not int or n < 0:
                _count(name, n)  # raises unless an int subclass
                odd = True
            elif n > p.hi - p.lo - p.num_live - p.num_pending:
                short = True
            elif n > p.small_batch:
                odd = True
        if self._pending or odd:  # fences, many blocks, int subclasses: can_alloc alone
            return {} if self.can_alloc(request) else None
        if short:
            return {} if self._fits(request) else None
        out = {}
        for name, n in request.items():  # alloc_packed's steady case
            p = pools[name]
            got = p.loops.take_bind(p.lo, p.hi, n, p.fenced_refs != 0, p.num_free_ids)
            assert got is not None, f"pool {p.name}: hole heap found fewer than {n} holes"
            p.bound(got[0])
            out[name] = got
        return out

    def max_alloc(self, pool: str) -> int:
        """The most blocks of ``pool`` one allocation could get now (after compaction). Changes
        nothing; agrees with :meth:`can_alloc`."""
        p = self._pool(pool)
        self._fences.retire()
        lo, hi = 0, p.max_slots - p.num_live - p.num_pending
        while lo < hi:  # largest n with a plan; plans are monotone in n
            mid = (lo + hi + 1) // 2
            if self._plan({p.name: mid}) is None:
                hi = mid - 1
            else:
                lo = mid
        return lo

    def free(self, pool: str, ids: IdsLike) -> None:
        """Free live ids (capacity returns at once; fenced slots are reused only after their
        fences retire). A foreign or already-free id raises ArenaError and frees nothing."""
        p = self._pool(pool)
        self._release(p, self._ids(p, ids).numpy())

    def free_owned(self, pool: str, ids: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """:meth:`free` for a caller that tracks its ids itself (the store's ledger does): ids
        it got from :meth:`alloc` / :meth:`alloc_ids` and has not freed, best as a list. Not
        re-validated here (a few µs per call on the store's hot path); a foreign or repeated
        id corrupts the tables, which :meth:`check_integrity` reports (the compiled loops
        refuse an id that is not live with ValueError before changing anything)."""
        p = self._pools.get(pool)
        if p is None:
            p = self._pool(pool)  # raises, naming the pools
        if type(ids) is list and len(ids) <= p.small_batch:  # the store's eviction
            p.free_few(ids)  # (one compiled call; trims the band when an end was freed)
        elif isinstance(ids, list | np.ndarray):
            self._release(p, ids)
        elif isinstance(ids, torch.Tensor):
            self._release(p, ids.to("cpu", torch.long).numpy())
        else:
            self._release(p, [int(i) for i in ids])

    def _release(self, p: Pool, ids: list[int] | np.ndarray) -> None:
        n = len(ids)
        if n == 0:
            return
        if n <= p.small_batch:  # (trims the band when an end was freed)
            p.free_few(ids.tolist() if isinstance(ids, np.ndarray) else list(ids))
            return
        array = p.release_array(np.asarray(ids, dtype=np.int64))
        if int(array.max()) == p.hi - 1 or int(array.min()) == p.lo:
            p.trim()

    def resolve(
        self, pool: str, ids: IdsLike, *, page_size: int = 1, sink: int | None = None
    ) -> torch.Tensor:
        """Physical slots of ``ids`` (per token ``slot * page_size + t`` when ``page_size > 1``),
        on the arena's device. Without ``sink`` every id must be live (else ArenaError); with
        ``sink`` invalid ids map to it instead. Changes nothing."""
        p = self._pool(pool)
        if page_size < 1:
            raise ArenaError(f"page_size must be >= 1, got {page_size}")
        ids = self._ids(p, ids, check=sink is None)
        table = self._views.table(p)
        return kernels.remap(table, ids.to(table.device), sink=-1 if sink is None else sink,
                             page_size=page_size)

    def read(self, pool: str, ids: IdsLike) -> torch.Tensor:
        """A copy of the blocks' bytes, ``[n, unit_bytes]`` uint8 on the arena's device."""
        p = self._pool(pool)
        slots = p.loc[self._ids(p, ids)].to(self.device)
        return self._views.rows(p).index_select(0, slots)

    def rows(self, pool: str, ids: IdsLike) -> list[torch.Tensor]:
        """The blocks' bytes without copying where possible: one ``[unit_bytes]`` view per id on
        a CPU arena (valid until the block moves or is freed: use it before the next arena
        call, or under a fence), one host copy split into rows on CUDA."""
        p = self._pool(pool)
        slots = p.loc[self._ids(p, ids)]
        view = self._views.rows(p)
        if self.device.type == "cuda":
            return list(view.index_select(0, slots.to(self.device)).cpu())
        return [view[int(s)] for s in slots]

    def write(self, pool: str, ids: IdsLike, data: torch.Tensor) -> None:
        """Overwrite the blocks' bytes with ``data`` (``[n, unit_bytes]`` uint8, any device)."""
        p = self._pool(pool)
        ids = self._ids(p, ids)
        want = (ids.numel(), p.unit)
        ok = isinstance(data, torch.Tensor) and data.dtype == torch.uint8
        if not ok or tuple(data.shape) != want:
            got = (tuple(data.shape), data.dtype) if isinstance(data, torch.Tensor) else type(data)
            raise ArenaError(f"pool {p.name!r}: write needs uint8 {want}, got {got}")
        slots = p.loc[ids].to(self.device)
        data = data.to(self.device)
        wide = self._views.wide(p)
        if wide is not None and data.is_contiguous():
            # 8-byte elements: torch copies uint8 rows element by element, ~3x slower
            wide.index_copy_(0, slots, data.view(torch.int64))
        else:
            self._views.rows(p).index_copy_(0, slots, data)

    def layer_view(
        self,
        pool: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        strides: Sequence[int] | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """A zero-copy ``[max_slots, *shape]`` view of one field (e.g. one layer's K) of every
        block of ``pool``: slot ``s``'s field starts ``offset`` bytes into the block; ``strides``
        are in elements. Index it with :meth:`resolve` slots. Stays valid across compaction."""
        return self._views.field(self._pool(pool), dtype, shape, strides, offset)

    def fence(self, pool: str, ids: IdsLike, mode: FenceMode, *,
              event: torch.cuda.Event | None = None) -> Fence:
        """Register an in-flight ``read`` or ``write`` of live blocks. On CUDA it records an event
        on the current stream (call it after enqueueing the work); on CPU the worker calls
        :meth:`Fence.complete`; ``event`` ties the fence to work already recorded elsewhere.
        Until then the blocks do not move and freed slots stay pending."""
        if mode not in ("read", "write"):
            raise ArenaError(f"fence mode must be 'read' or 'write', got {mode!r}")
        p = self._pool(pool)
        slots = p.loc[self._ids(p, ids)]
        if event is None and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return self._fences.add(p, slots, mode, event)

    def copy_to(
        self, pool: str, ids: IdsLike, dest: Arena, dest_ids: IdsLike,
        stream: torch.cuda.Stream | None = None,
    ) -> tuple[Fence, Fence] | None:
        """Copy live blocks of ``pool`` into live blocks of the same pool of ``dest`` (another
        arena, e.g. device <-> host) in one batched copy. With a CUDA buffer on either side the
        copy is enqueued on ``stream`` (default: the current stream) and a read fence on the
        source and a write fence on the destination are returned; the caller waits on either
        before trusting the destination. On CPU it completes before returning (None)."""
        p, q = self._pool(pool), dest._pool(pool)
        if p.unit != q.unit:
            raise ArenaError(f"pool {pool!r}: units differ ({p.unit} vs {q.unit} bytes)")
        src_ids, dst_ids = self._ids(p, ids), dest._ids(q, dest_ids)
        if src_ids.numel() != dst_ids.numel():
            raise ArenaError(f"pool {pool!r}: {src_ids.numel()} source ids, "
                             f"{dst_ids.numel()} destination ids")
        if src_ids.numel() == 0 or "meta" in (self.device.type, dest.device.type):
            return None
        on_cuda = "cuda" in (self.device.type, dest.device.type)
        copy_device = self.device if self.device.type == "cuda" else dest.device
        context = torch.cuda.stream(stream) if on_cuda and stream is not None else nullcontext()
        with context:
            kernels.strided_copy(self._buf, dest._buf, p.loc[src_ids].to(copy_device),
                                 q.loc[dst_ids].to(copy_device), nbytes=p.unit,
                                 src_stride=p.unit, dst_stride=q.unit, src_offset=p.origin,
                                 dst_offset=q.origin)
            if not on_cuda:
                return None
            event = torch.cuda.Event()
            event.record()
            return (self.fence(pool, src_ids, "read", event=event),
                    dest.fence(pool, dst_ids, "write", event=event))

    def compact(self, max_moves: int | None = None) -> int:
        """Close holes by moving blocks from each band's inner edge into holes nearer its anchor
        (the float band packs toward its low side); at most ``max_moves`` blocks. Blocks with a
        pending write fence stay; a moved block's old slot stays pending while readers of it are
        in flight. Returns the number of blocks moved."""
        self._fences.retire()
        budget = max_moves if max_moves is not None else 1 << 62
        moved = 0
        for p in self._pools.values():
            if budget - moved <= 0:
                break
            moved += compaction.pack(self._buf, p, budget - moved)
        if moved:
            self.compactions += 1
        return moved

    def stats(self) -> ArenaStats:
        """Occupancy per pool, band edges, gap and moves so far."""
        self._fences.retire()
        pools = {
            p.name: PoolStats(
                unit_bytes=p.unit, anchor=p.anchor, live_blocks=p.num_live,
                live_bytes=p.num_live * p.unit, hole_bytes=p.num_holes * p.unit,
                pending_bytes=p.num_pending * p.unit, band_start=p.start, band_end=p.end,
                moves=p.moves, allocated=p.allocated,
            )
            for p in self._pools.values()
        }
        used = sum(p.end - p.start for p in self._pools.values())
        return ArenaStats(capacity_bytes=self.capacity_bytes, gap_bytes=self.capacity_bytes - used,
                          moves=sum(p.moves for p in self._pools.values()),
                          compactions=self.compactions, pending_fences=len(self._fences),
                          pools=pools,
                          moved_bytes=sum(p.moves * p.unit for p in self._pools.values()),
                          allocated_bytes=sum(p.allocated * p.unit for p in self._pools.values()))

    def visited_slots(self) -> int:
        """Slots visited by the arena's scans so far, all pools (for tests and benchmarks:
        allocation and compaction visit about what they hand out or move, never a band)."""
        return sum(p.visited for p in self._pools.values())

    def check_integrity(self) -> None:
        """Raise IntegrityError if any invariant is broken: tables consistent, every live id in
        exactly one slot of its band, bands disjoint and ordered, fence counts match fences."""
        previous_end = 0
        for p in self._pools.values():
            p.check()
            if p.hi > p.lo:
                if p.start < previous_end or p.end > self.capacity_bytes:
                    raise IntegrityError(
                        f"band {p.name} [{p.start},{p.end}) overlaps a lower band ending at "
                        f"{previous_end} or the capacity {self.capacity_bytes}"
                    )
                previous_end = p.end
        self._fences.check()

    # ================================================================ internals
    def _pool(self, name: str) -> Pool:
        try:
            return self._pools[name]
        except KeyError:
            raise ArenaError(f"unknown pool {name!r}; pools are {list(self._pools)}") from None

    def _ids(self, p: Pool, ids: IdsLike, *, check: bool = True) -> torch.Tensor:
        return checked_ids(p, ids, check=check)

    def _free_slots(self, p: Pool, n: int) -> list[int] | np.ndarray | None:
        """Free slots for ``n`` new blocks (a list for a few, an array past the pool's
        ``small_batch``), compacting when holes and the gap are not enough; ``None`` (nothing
        changed) when even that cannot make room."""
        if self._pending:
            self._fences.retire()
        if n <= p.num_holes:  # the steady state: reuse what eviction freed, nothing moves
            holes = p.take_holes(n)
            return holes if n <= p.small_batch else np.asarray(holes, dtype=np.int64)
        return self._grow(p, n)

    def _grow(self, p: Pool, n: int) -> list[int] | np.ndarray | None:
        """:meth:`_free_slots` past the holes: the gap, else a compaction."""
        slots = self._direct(p, n)
        if slots is None:
            plan = self._plan({p.name: n})
            if plan is None:
                return None
            compaction.execute(self._buf, self._low, self._float, self._high, plan)
            self.compactions += 1
            slots = self._direct(p, n)
            assert slots is not None, f"pool {p.name}: plan said {n} fit after compaction"
        return slots

    def _direct(self, p: Pool, n: int) -> list[int] | np.ndarray | None:
        """Slots for ``n`` new blocks from holes and the adjacent gap, growing the band; ``None``
        (nothing changed) when they do not fit without moving blocks."""
        n_holes = min(n, p.num_holes)
        need = n - n_holes
        if need == 0:
            return p.take_holes(n)
        lower, upper = limits(self._pool_list, p, self.capacity_bytes)
        first_fit = max(0, ceil_div(lower - p.origin, p.unit))  # lowest slot above `lower`
        last_fit = (upper - p.origin) // p.unit  # one past the highest slot below `upper`
        if p.hi == p.lo and p.anchor == "float":  # an empty floating band may start anywhere
            if last_fit - first_fit < need:
                return None
            p.lo = p.hi = float_start(self._low, self._high, first_fit, last_fit, need)
        up = last_fit - p.hi if p.anchor != "high" else 0
        down = p.lo - first_fit if p.anchor != "low" else 0
        if up + down < need or (p.hi - p.lo) + need > p.cap:
            return None
        holes = p.take_holes(n_holes)
        n_up = min(up, need)
        n_down = need - n_up
        below, above = range(p.lo - n_down, p.lo), range(p.hi, p.hi + n_up)
        p.lo -= n_down
        p.hi += n_up
        if n <= p.small_batch:
            return holes + list(below) + list(above)
        return np.concatenate([np.asarray(holes, dtype=np.int64),
                               np.arange(below.start, below.stop, dtype=np.int64),
                               np.arange(above.start, above.stop, dtype=np.int64)])

    def _plan(self, request: Mapping[str, int]) -> Plan | None:
        return plan(self._low, self._float, self._high, self.capacity_bytes, request)


def _count(pool: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ArenaError(f"pool {pool!r}: block count must be a non-negative int, got {n!r}")
    return n
