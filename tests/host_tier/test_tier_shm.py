"""The host tier's arena in a shared segment (an arena over an external buffer)."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_arena import Arena, ArenaError, PoolSpec
from host_tier import HostTier
from host_tier.shm import SHM_DIR, SharedSegment, available

U = 256
POOLS = [PoolSpec("state", 2 * U, "low"), PoolSpec("kv", U, "high")]


def test_arena_uses_the_buffer_it_is_given() -> None:
    buffer = torch.zeros(16 * U, dtype=torch.uint8)
    arena = Arena(16 * U, POOLS, buffer=buffer)
    ids = arena.alloc("kv", 2)
    assert ids is not None
    arena.write("kv", ids, torch.full((2, U), 9, dtype=torch.uint8))
    assert int((buffer == 9).sum()) == 2 * U and arena.buffer is buffer
    for bad in (torch.zeros(8 * U, dtype=torch.uint8), torch.zeros(16 * U, dtype=torch.int8),
                torch.zeros(32 * U, dtype=torch.uint8)[::2]):
        with pytest.raises(ArenaError, match="buffer must be contiguous uint8"):
            Arena(16 * U, POOLS, buffer=bad)


@pytest.mark.skipif(not available(1 << 20), reason="no usable /dev/shm")
def test_host_tier_in_shared_memory_round_trips_and_is_mappable() -> None:
    device = Arena(16 * U, POOLS)
    host = HostTier(16 * U, POOLS, shared=True)
    try:
        assert host.segment is not None
        src, dst = device.alloc("kv", 3), host.arena.alloc("kv", 3)
        assert src is not None and dst is not None
        data = torch.randint(0, 256, (3, U), dtype=torch.uint8)
        device.write("kv", src, data)
        host.store(device, "kv", src, dst)
        other = SharedSegment.attach(host.segment.name, host.segment.nonce, 16 * U)
        slots = host.arena.resolve("kv", dst)
        mapped = other.tensor.view(-1, U)  # another mapping of the same bytes
        assert torch.equal(mapped[slots], data)
        back = device.alloc("kv", 3)
        assert back is not None
        host.load(device, "kv", dst, back)
        assert torch.equal(device.read("kv", back), data)
        host.check_integrity()
        other.close()
    finally:
        host.close()
    assert not os.path.exists(os.path.join(SHM_DIR, host.segment.name))
