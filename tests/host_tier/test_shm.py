"""Shared segments (create 0600, attach by name + nonce, unlink) and the byte-range allocator."""

from __future__ import annotations

import gc
import os
import signal
import stat
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from host_tier.shm import HEADER_BYTES, SHM_DIR, SharedSegment, ShmError, available
from host_tier.slots import ALIGN, ByteSlots, SlotError, aligned

pytestmark = pytest.mark.skipif(not available(1 << 20), reason="no usable /dev/shm")


def test_segment_is_private_unguessable_and_unlinked() -> None:
    a, b = SharedSegment.create(1 << 16), SharedSegment.create(1 << 16)
    try:
        assert a.name != b.name and len(a.name) >= 32
        mode = os.stat(os.path.join(SHM_DIR, a.name)).st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert os.path.getsize(os.path.join(SHM_DIR, a.name)) == HEADER_BYTES + (1 << 16)
        assert a.tensor.numel() == 1 << 16 and int(a.tensor.sum()) == 0
    finally:
        a.close()
        b.close()
    assert not os.path.exists(os.path.join(SHM_DIR, a.name))
    a.close()  # idempotent


def test_another_process_sees_the_bytes_and_writes_back() -> None:
    with SharedSegment.create(4096) as seg:
        seg.tensor[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
        code = ("import sys, torch; from host_tier.shm import SharedSegment as S; "
                "s = S.attach(sys.argv[1], bytes.fromhex(sys.argv[2]), 4096); "
                "print(s.tensor[:5].tolist()); s.tensor[100] = 42; s.close()")
        out = subprocess.run([sys.executable, "-c", code, seg.name, seg.nonce.hex()],
                             capture_output=True, text=True, check=True, timeout=120)
        assert out.stdout.strip() == "[1, 2, 3, 4, 5]"
        assert int(seg.tensor[100]) == 42
        assert os.path.exists(os.path.join(SHM_DIR, seg.name))  # an attacher never unlinks


def test_attach_checks_name_size_and_nonce() -> None:
    with SharedSegment.create(4096) as seg:
        with pytest.raises(ShmError, match="not the one announced"):
            SharedSegment.attach(seg.name, os.urandom(32), 4096)
        with pytest.raises(ShmError, match="not the one announced"):
            SharedSegment.attach(seg.name, seg.nonce, 8192)
        with pytest.raises(ShmError, match="not a segment name"):
            SharedSegment.attach("../etc/passwd", seg.nonce, 4096)
        other = SharedSegment.attach(seg.name, seg.nonce, 4096)
        other.close()
    with pytest.raises(ShmError, match="cannot open"):
        SharedSegment.attach(seg.name, seg.nonce, 4096)


def test_owner_segments_are_unlinked_at_exit() -> None:
    code = ("from host_tier.shm import SharedSegment as S; s = S.create(4096); "
            "print(s.name, flush=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert not os.path.exists(os.path.join(SHM_DIR, out.stdout.strip()))


def test_a_dropped_handle_unlinks_its_segment() -> None:
    seg = SharedSegment.create(4096)
    path = os.path.join(SHM_DIR, seg.name)
    del seg
    gc.collect()
    assert not os.path.exists(path)


def test_a_killed_creators_segment_is_swept_by_the_next_create() -> None:
    code = ("import sys, time; from host_tier.shm import SharedSegment as S; "
            "s = S.create(4096); print(s.name, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        path = os.path.join(SHM_DIR, name)
        with SharedSegment.create(4096):  # the creator is alive: its segment stays
            assert os.path.exists(path)
        child.send_signal(signal.SIGKILL)  # cannot unlink anything now
        child.wait(timeout=30)
        assert os.path.exists(path)
        with SharedSegment.create(4096):
            assert not os.path.exists(path)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def test_close_with_live_views_keeps_them_readable() -> None:
    seg = SharedSegment.create(4096)
    view = seg.tensor[:8]
    view.fill_(7)
    seg.close()
    assert seg.closed and view.tolist() == [7] * 8


# ------------------------------------------------------------------ ByteSlots
def test_slots_reuse_exact_holes_and_merge_neighbours() -> None:
    slots = ByteSlots(10 * ALIGN)
    a, b, c = (slots.alloc(ALIGN) for _ in range(3))
    assert (a, b, c) == (0, ALIGN, 2 * ALIGN)
    assert slots.alloc(100) == 3 * ALIGN and slots.size(3 * ALIGN) == ALIGN
    assert b is not None and a is not None
    slots.free(b)
    assert slots.alloc(ALIGN) == b  # the exact hole, not the tail
    slots.free(a)
    slots.free(b)
    assert slots.alloc(2 * ALIGN) == 0  # a and b merged
    assert slots.alloc(7 * ALIGN) is None and slots.alloc(6 * ALIGN) == 4 * ALIGN
    assert slots.free_bytes == 0
    slots.check_integrity()
    with pytest.raises(SlotError, match="no allocated range starts at 1"):
        slots.free(1)
    with pytest.raises(SlotError):
        slots.alloc(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=80))
def test_slots_never_overlap_and_account_every_byte(ops: list[tuple[bool, int]]) -> None:
    slots = ByteSlots(64 * ALIGN)
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            start = slots.alloc(n)
            if start is None:
                assert all(size < aligned(n) for size in slots._free.values())
                continue
            assert start % ALIGN == 0 and start + aligned(n) <= slots.capacity
            assert all(start + aligned(n) <= s or s + z <= start for s, z in live.items())
            live[start] = aligned(n)
        else:
            victim = sorted(live)[n % len(live)]
            slots.free(victim)
            del live[victim]
        slots.check_integrity()
        assert slots.used_bytes == sum(live.values())
