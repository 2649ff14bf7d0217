"""BufferPool: a buffer is reused only when no caller can still see it."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from remote_tier.buffers import BufferPool


def _addr(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def test_reuses_only_idle_buffers() -> None:
    pool = BufferPool(1 << 20)
    a = pool.take(1000)
    addr_a = _addr(a)
    b = pool.take(1000)
    assert _addr(b) != addr_a, "a buffer still held must not be handed out again"
    del a
    gc.collect()
    c = pool.take(1000)
    assert _addr(c) == addr_a and pool.num_reused == 1
    assert pool.num_bytes == 2000


@pytest.mark.parametrize(
    "keep",
    [
        lambda v: v[10:20],
        lambda v: np.frombuffer(v, np.uint8),
        lambda v: memoryview(v).cast("B"),
        lambda v: [v],
    ],
)
def test_any_derived_reference_keeps_a_buffer_busy(keep: object) -> None:
    pool = BufferPool(1 << 20)
    view = pool.take(4096)
    held = keep(view)  # type: ignore[operator]
    addr = _addr(view)
    del view
    assert _addr(pool.take(4096)) != addr
    del held
    gc.collect()
    assert _addr(pool.take(4096)) == addr


def test_bounded_and_drops_idle_buffers_of_other_sizes() -> None:
    pool = BufferPool(10_000)
    big = [pool.take(4000) for _ in range(3)]  # the third is not pooled
    assert pool.num_bytes == 8000
    del big
    gc.collect()
    small = pool.take(3000)
    assert pool.num_bytes == 3000 and len(small) == 3000
    with pytest.raises(ValueError):
        BufferPool(-1)


def test_zero_bytes_pools_nothing() -> None:
    pool = BufferPool(0)
    view = pool.take(100)
    assert len(view) == 100 and pool.num_bytes == 0
