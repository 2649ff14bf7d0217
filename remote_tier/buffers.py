"""``BufferPool``: receive buffers that are reused once no caller holds them any more.

``get_many`` without caller buffers returns views into buffers the tier allocated. A fresh
multi-MiB allocation per value costs page faults (glibc returns freed large blocks to the
kernel), about a third of what receiving the value costs. The pool keeps the buffers it
handed out and reuses one only when nothing but the pool refers to it — every returned view,
slice or numpy array over it keeps a reference (CPython reference counts are exact), so a
caller may keep a result as long as it likes and never sees it overwritten.
"""

from __future__ import annotations

import sys

import numpy as np

# References to a pooled array while the pool inspects it: the pool's list, the loop
# variable and getrefcount's own argument.
_IDLE_REFS = 3


class BufferPool:
    """Buffers by exact size, at most ``max_bytes`` in all; bookkeeping only, one event loop."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._max_bytes = max_bytes
        self._by_size: dict[int, list[np.ndarray]] = {}
        self.num_bytes = 0
        self.num_reused = 0

    def take(self, size: int) -> memoryview:
        """A writable ``size``-byte buffer, uninitialised: an idle pooled one if there is one,
        else a new one (pooled while the pool has room)."""
        arrays = self._by_size.get(size)
        if arrays:
            for arr in arrays:
                if sys.getrefcount(arr) <= _IDLE_REFS:
                    self.num_reused += 1
                    return arr.data
        arr = np.empty(size, np.uint8)
        if self.num_bytes + size > self._max_bytes:
            self._drop_idle(exclude=size)
        if self.num_bytes + size <= self._max_bytes:
            self._by_size.setdefault(size, []).append(arr)
            self.num_bytes += size
        return arr.data

    def _drop_idle(self, exclude: int) -> None:
        """Forget idle buffers of other sizes (the sizes in demand change rarely)."""
        for size, arrays in list(self._by_size.items()):
            if size == exclude:
                continue
            keep = [a for a in arrays if sys.getrefcount(a) > _IDLE_REFS]
            self.num_bytes -= size * (len(arrays) - len(keep))
            if keep:
                self._by_size[size] = keep
            else:
                del self._by_size[size]
