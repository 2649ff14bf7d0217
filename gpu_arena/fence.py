"""Fences: markers for reads and writes of arena blocks that are still in flight."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Literal

import torch

from gpu_arena.pool import Pool
from gpu_arena.spec import IntegrityError

FenceMode = Literal["read", "write"]


class Fence:
    """An in-flight read or write of some slots of one pool.

    On CUDA the fence is an event recorded on the stream doing the work; on CPU it is a flag the
    worker sets with :meth:`complete`. While a fence is pending, the slots it covers are never
    reused or moved: freeing them leaves them *pending*, and compaction leaves them in place.
    """

    def __init__(
        self, pool: str, slots: torch.Tensor, mode: FenceMode, event: torch.cuda.Event | None
    ) -> None:
        self.pool = pool
        self.slots = slots
        self.mode = mode
        self._event = event
        self._flag = threading.Event()

    @property
    def event(self) -> torch.cuda.Event | None:
        """The CUDA event behind the fence (None for a CPU fence)."""
        return self._event

    def done(self) -> bool:
        """True once the work behind the fence has finished."""
        if self._event is not None:
            return bool(self._event.query())
        return self._flag.is_set()

    def complete(self) -> None:
        """Mark a CPU fence finished (safe from any thread). CUDA fences finish by themselves."""
        self._flag.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the fence is done (or ``timeout`` seconds pass); return whether it is."""
        if self._event is not None:
            self._event.synchronize()
            return True
        return self._flag.wait(timeout)

    def __enter__(self) -> Fence:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._event is None:
            self.complete()

    def __repr__(self) -> str:
        return f"Fence({self.pool!r}, {self.mode}, n={self.slots.numel()}, done={self.done()})"


class Fences:
    """An arena's pending fences, counted on the slots they cover: registered by
    :meth:`add`, dropped by :meth:`retire` once their work has finished."""

    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self._pools = pools
        # Changed in place only: the arena's hot paths test this very list for emptiness.
        self.pending: list[Fence] = []

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, p: Pool, slots: torch.Tensor, mode: FenceMode,
            event: torch.cuda.Event | None) -> Fence:
        """Count a new fence on ``slots`` of ``p``: they neither move nor get reused until it
        retires."""
        p.add_fence(slots, mode == "write", +1)
        fence = Fence(p.name, slots, mode, event)
        self.pending.append(fence)
        return fence

    def retire(self) -> None:
        """Drop fences whose work has finished; their slots become movable / reusable."""
        if not self.pending:
            return
        still: list[Fence] = []
        touched: set[str] = set()
        for f in self.pending:
            if f.done():
                self._pools[f.pool].add_fence(f.slots, f.mode == "write", -1)
                touched.add(f.pool)
            else:
                still.append(f)
        self.pending[:] = still
        for name in touched:
            self._pools[name].trim()

    def check(self) -> None:
        """Raise IntegrityError unless every pool's fence counts are its pending fences."""
        for p in self._pools.values():
            want_r = torch.zeros(p.max_slots, dtype=torch.int32)
            want_w = torch.zeros(p.max_slots, dtype=torch.int32)
            for f in self.pending:
                if f.pool == p.name:
                    counts = want_w if f.mode == "write" else want_r
                    counts.index_add_(0, f.slots, torch.ones_like(f.slots, dtype=torch.int32))
            if not (torch.equal(want_r, p.readers) and torch.equal(want_w, p.writers)):
                raise IntegrityError(f"pool {p.name}: fence counts disagree with pending fences")
