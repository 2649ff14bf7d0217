"""Fences: markers for reads and writes of arena blocks that are still in flight."""

from __future__ import annotations

import threading
from typing import Literal

import torch

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
