"""L2: an arena on host memory, with batched copies to and from a device arena."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from gpu_arena import Arena, Fence, PoolSpec
from host_tier.shm import SharedSegment, ShmError

log = logging.getLogger(__name__)

IdsLike = torch.Tensor | Sequence[int]


class HostTier:
    """Host memory holding the same envelope pools as the device arena.

    The buffer is pinned when CUDA exists (so device <-> host copies are asynchronous DMA or
    kernel reads of mapped memory) and plain CPU memory otherwise. Copies run on a private CUDA
    stream that first waits for the caller's stream; each returns the fences it registered
    (a read fence on the source, a write fence on the destination), so neither side's blocks
    are moved or reused until the copy has finished. On CPU copies complete at once.
    With ``shared`` the arena lives in a named shared-memory segment (0600, unlinked on
    :meth:`close` or exit; pinned with ``cudaHostRegister`` when CUDA exists) that a process of
    the same user on this host can map by ``segment.name``; without ``/dev/shm`` it falls back
    to private memory. It keeps no policy: the store decides what to demote and promote.
    """

    def __init__(self, capacity_bytes: int, pools: Sequence[PoolSpec], *,
                 pin_memory: bool | None = None, shared: bool = False) -> None:
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.segment: SharedSegment | None = None
        if shared:
            try:
                self.segment = SharedSegment.create(capacity_bytes, prefix="tierstore-l2")
            except ShmError as exc:
                log.warning("host tier in private memory: %s", exc)
        if self.segment is not None:
            self.arena = Arena(capacity_bytes, pools, "cpu", buffer=self.segment.tensor)
            self.pinned = self.segment.pinned
        else:
            self.arena = Arena(capacity_bytes, pools, "cpu", pin_memory=pin)
            self.pinned = bool(pin)
        self._stream: torch.cuda.Stream | None = None
        log.info("host tier: %.1f MiB, pinned=%s, shared=%s", capacity_bytes / 2**20,
                 self.pinned, self.segment is not None)

    def _copy_stream(self, device: Arena) -> torch.cuda.Stream | None:
        if device.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device.device)
        self._stream.wait_stream(torch.cuda.current_stream(device.device))
        return self._stream

    def store(self, device: Arena, pool: str, device_ids: IdsLike, host_ids: IdsLike
              ) -> tuple[Fence, Fence] | None:
        """Copy device blocks down into host blocks (demotion); returns the copy's fences."""
        return device.copy_to(pool, device_ids, self.arena, host_ids, self._copy_stream(device))

    def load(self, device: Arena, pool: str, host_ids: IdsLike, device_ids: IdsLike
             ) -> tuple[Fence, Fence] | None:
        """Copy host blocks up into device blocks (promotion); returns the copy's fences. The
        caller's stream must wait on the returned write fence before reading the blocks."""
        fences = self.arena.copy_to(pool, host_ids, device, device_ids, self._copy_stream(device))
        if fences is not None and fences[1].event is not None:
            torch.cuda.current_stream(device.device).wait_event(fences[1].event)
        return fences

    def check_integrity(self) -> None:
        """Raise IntegrityError if the host arena's invariants are broken."""
        self.arena.check_integrity()

    def close(self) -> None:
        """Unlink the shared segment, if any (the arena's views keep the memory until freed)."""
        if self.segment is not None:
            self.segment.close()
