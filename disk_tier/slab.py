"""One preallocated file of fixed-size slots, and positional vectored I/O on it.

The file is opened with ``O_DIRECT`` where the filesystem takes it (ext4, xfs on NVMe): a
probe read of one aligned block at open decides, and :attr:`SlabFile.direct` says which is
used. tmpfs and some overlay filesystems refuse ``O_DIRECT`` (``EINVAL``); there the file is
read and written through the page cache, which on tmpfs *is* the storage. Buffers handed to
the I/O calls are aligned to :data:`~disk_tier.slot.ALIGN` either way, and every transfer is
whole slots, so both modes run the same code.

Runs of consecutive slots go down as one ``os.preadv`` / ``os.pwritev`` (one iovec per slot);
both release the GIL, so the worker threads of :class:`~disk_tier.tier.DiskTier` overlap them.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from disk_tier.slot import ALIGN

log = logging.getLogger(__name__)

MAX_IOV = 512  # iovecs per call (Linux allows 1024)
MAX_RUN_BYTES = 2 << 20  # one call moves at most this much, so large batches spread out


def aligned(nbytes: int, *, zero: bool = True) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` starting on an ``ALIGN`` boundary; zeroed unless ``zero``
    is False (a read fills it whole; a write must not send stale memory in its padding)."""
    raw = (np.zeros if zero else np.empty)(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


def runs(slots: Sequence[int], slot_size: int) -> Iterator[tuple[int, int]]:
    """``(first index into slots, count)`` of each run of consecutive slot numbers (slots in
    the order given), cut at ``MAX_IOV`` slots or ``MAX_RUN_BYTES``."""
    cap = max(1, min(MAX_IOV, MAX_RUN_BYTES // slot_size))
    i, n = 0, len(slots)
    while i < n:
        j = i + 1
        while j < n and j - i < cap and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, j - i
        i = j


class SlabFile:
    """``nslots`` slots of ``slot_size`` bytes in the file at ``path`` (created or resized
    to ``nslots * slot_size``; space is reserved with ``posix_fallocate`` where the
    filesystem supports it)."""

    def __init__(self, path: str, nslots: int, slot_size: int, *, direct: bool | None = None
                 ) -> None:
        assert slot_size % ALIGN == 0, "slots are whole alignment blocks"
        self.path = path
        self.nslots = nslots
        self.slot_size = slot_size
        self.size = nslots * slot_size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size != self.size:
                os.ftruncate(fd, self.size)
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:  # tmpfs beyond its size, or a filesystem without it
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        finally:
            os.close(fd)
        self.direct = False
        self.fd = -1
        if direct is not False:
            self.direct = self._open_direct()
            if direct and not self.direct:
                log.warning("%s: the filesystem refuses O_DIRECT; using buffered I/O", path)
        if not self.direct:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def _open_direct(self) -> bool:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | flag)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return False
        try:  # some filesystems accept the flag at open and refuse the I/O
            if self.size:
                os.preadv(fd, [aligned(ALIGN).data], 0)
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.EINVAL:
                raise
            return False
        self.fd = fd
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, first: int, views: Sequence[memoryview | np.ndarray]) -> None:
        """Fill ``views`` (aligned, ``slot_size`` bytes each) from slots ``first``,
        ``first + 1``, ... in one vectored read (more on a short read)."""
        self._io(os.preadv, first, views)

    def write(self, first: int, views: Sequence[memoryview | np.ndarray]) -> None:
        """Write ``views`` to slots ``first``, ``first + 1``, ... in one vectored write."""
        self._io(os.pwritev, first, views)

    def _io(self, call: Callable[[int, list[memoryview], int], int], first: int,
            views: Sequence[memoryview | np.ndarray]) -> None:
        assert first >= 0 and first + len(views) <= self.nslots, "slot out of range"
        offset = first * self.slot_size
        pending = [(v.data if isinstance(v, np.ndarray) else v).cast("B") for v in views]
        while pending:
            n = call(self.fd, pending, offset)
            if n <= 0:
                raise OSError(errno.EIO, f"{self.path}: I/O stopped at byte {offset}")
            offset += n
            while pending and n >= len(pending[0]):  # a short transfer: go on from there
                n -= len(pending.pop(0))
            if n:
                pending[0] = pending[0][n:]
