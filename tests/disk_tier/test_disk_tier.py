"""DiskTier on real files in a temporary directory: slots, round trips, restarts, damage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import blake3
import numpy as np
import pytest

from disk_tier import DiskTier, DiskTierError, SlotMeta
from disk_tier.slot import HEADER_BYTES
from remote_tier.mac import Mac

SECRET = b"s" * 32
UNITS = {"kv": 20_000, "swa": 5_000, "state": 70_000}


def body(key: bytes, unit: int) -> np.ndarray:
    """The bytes a test stores under ``key``: a function of the key alone."""
    return np.frombuffer(blake3.blake3(key).digest(length=unit), np.uint8)


def meta(i: int) -> SlotMeta:
    return SlotMeta(blake3.blake3(str(i).encode()).digest(), b"p" * 32 if i else b"", i)


def open_tier(path: Path, size: int = 8 << 20, secret: bytes = SECRET, fp: str = "layout-a",
              **kw: object) -> DiskTier:
    return DiskTier(path, size, UNITS, fp, Mac(secret), **kw)  # type: ignore[arg-type]


def fill(tier: DiskTier, kind: str, first: int, n: int) -> tuple[list[int], list[SlotMeta]]:
    slots = tier.alloc(kind, n)
    assert slots is not None
    metas = [meta(i) for i in range(first, first + n)]
    rows = np.stack([body(m.key, UNITS[kind]) for m in metas])
    assert tier.write(kind, slots, rows, metas) == [True] * n
    return slots, metas


def test_slabs_split_the_size_and_alloc_free_round_trip(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        assert set(tier.nslots) == set(UNITS)
        assert tier.capacity_bytes <= 8 << 20
        assert tier.nslots["kv"] == tier.nslots["swa"] > tier.nslots["state"] >= 1
        total = tier.free_slots("kv")
        slots = tier.alloc("kv", 3)
        assert slots == [0, 1, 2] and tier.free_slots("kv") == total - 3
        assert tier.alloc("kv", total) is None  # not enough: nothing taken
        assert tier.free_slots("kv") == total - 3
        tier.free("kv", slots)
        assert tier.free_slots("kv") == total and tier.can_alloc({"kv": total})
        assert not tier.can_alloc({"kv": total + 1})


def test_too_small_a_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match="one slot per kind"):
        open_tier(tmp_path, size=4096)


def test_byte_exact_round_trip_in_both_io_modes(tmp_path: Path) -> None:
    for direct in (None, False):
        where = tmp_path / str(direct)
        with open_tier(where, direct=direct) as tier:
            for kind in UNITS:
                slots, metas = fill(tier, kind, 0, 5)
                rows, ok = tier.read(kind, slots)
                assert ok == [True] * 5
                for row, m in zip(rows, metas, strict=True):
                    assert np.array_equal(row, body(m.key, UNITS[kind]))
            assert tier.snapshot()["used"] == {k: 5 for k in UNITS}


def test_restart_finds_what_was_written_and_the_newest_copy_wins(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        slots, metas = fill(tier, "kv", 0, 6)
        again, _ = fill(tier, "kv", 0, 1)  # a newer copy of key 0 in another slot
    with open_tier(tmp_path) as tier:
        found = {(r.kind, r.slot): r for r in tier.recovered}
        assert set(found) == {("kv", s) for s in slots[1:] + again}
        assert all(found[("kv", s)].meta == m for s, m in zip(slots[1:], metas[1:],
                                                               strict=True))
        rows, ok = tier.read("kv", [r.slot for r in tier.recovered])
        assert all(ok)
        for r, row in zip(tier.recovered, rows, strict=True):
            assert np.array_equal(row, body(r.meta.key, UNITS["kv"]))
        assert slots[0] in (tier.alloc("kv", tier.free_slots("kv")) or [])  # stale: free


def test_another_size_or_layout_starts_empty(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        fill(tier, "kv", 0, 2)
    with open_tier(tmp_path, fp="layout-b") as tier:  # same slots, another layout
        assert tier.recovered == []
    with open_tier(tmp_path, size=16 << 20) as tier:  # other slot counts: recreated
        assert tier.recovered == []


def test_the_directory_is_used_by_one_tier_at_a_time(tmp_path: Path) -> None:
    with open_tier(tmp_path), pytest.raises(DiskTierError, match="in use"):
        open_tier(tmp_path)
    open_tier(tmp_path).close()  # free again once the first closed


def test_torn_forged_stale_and_foreign_slots_are_misses(tmp_path: Path) -> None:
    unit, size = UNITS["kv"], 0
    with open_tier(tmp_path) as tier:
        slots, metas = fill(tier, "kv", 0, 4)
        size = tier.slot_size["kv"]
    path = tmp_path / "kv.slab"
    raw = bytearray(path.read_bytes())
    # slot 0: a torn write, the new header over the old body's first half
    with open_tier(tmp_path / "other") as other:
        fill(other, "kv", 100, 1)
        other_raw = (tmp_path / "other" / "kv.slab").read_bytes()
    raw[0:HEADER_BYTES + unit // 2] = other_raw[0:HEADER_BYTES + unit // 2]
    # slot 1: one body byte flipped; slot 2: the body of slot 3 with slot 2's header
    raw[size + HEADER_BYTES + 7] ^= 1
    raw[2 * size + HEADER_BYTES:2 * size + HEADER_BYTES + unit] = \
        raw[3 * size + HEADER_BYTES:3 * size + HEADER_BYTES + unit]
    path.write_bytes(bytes(raw))
    with open_tier(tmp_path) as tier:
        rows, ok = tier.read("kv", slots, [m.key for m in metas])
        assert ok == [False, False, False, True]
        assert np.array_equal(rows[3], body(metas[3].key, unit))
        assert tier.stats.misses == 3
        # a slot asked for under another key is a miss too
        _, ok = tier.read("kv", [slots[3]], [metas[0].key])
        assert ok == [False]
    with open_tier(tmp_path, secret=b"t" * 32) as tier:  # another deployment's secret
        _, ok = tier.read("kv", [r.slot for r in tier.recovered])
        assert not any(ok)


WRITER = textwrap.dedent("""
    import sys, blake3, numpy as np
    from disk_tier import DiskTier, SlotMeta
    from remote_tier.mac import Mac
    unit = 1 << 20
    tier = DiskTier(sys.argv[1], 24 << 20, {"kv": unit}, "layout-a", Mac(b"s" * 32))
    n, i = tier.nslots["kv"], 0
    print("ready", flush=True)
    while True:  # rewrite every slot, forever, with bodies that depend on the key only
        slots = list(range(i % n, min(n, i % n + 4)))
        metas = [SlotMeta(blake3.blake3(str(i + k).encode()).digest(), b"", 0)
                 for k in range(len(slots))]
        rows = np.stack([np.frombuffer(blake3.blake3(m.key).digest(length=unit), np.uint8)
                         for m in metas])
        tier.free("kv", slots)
        tier.alloc("kv", len(slots))
        tier.write("kv", slots, rows, metas)
        i += len(slots)
""")


def test_a_writer_killed_mid_write_leaves_only_right_bytes_or_misses(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    seen = verified = 0
    for round_ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env,
                                stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(0.05 + 0.07 * round_)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        tier = DiskTier(tmp_path, 24 << 20, {"kv": 1 << 20}, "layout-a", Mac(SECRET))
        try:
            rows, ok = tier.read("kv", [r.slot for r in tier.recovered])
            for r, row, good in zip(tier.recovered, rows, ok, strict=True):
                if good:
                    assert np.array_equal(row, body(r.meta.key, 1 << 20))
            seen += len(ok)
            verified += sum(ok)
        finally:
            tier.close()
    assert verified > 0 and seen >= verified


def test_a_size_the_filesystem_cannot_hold_is_a_clear_error(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(DiskTierError, match="cannot set up the disk tier file"):
        open_tier(tmp_path, size=free * 4 + (1 << 40))
    open_tier(tmp_path).close()  # the lock was given back


CUT = textwrap.dedent("""
    import os, signal, sys, blake3, numpy as np
    from disk_tier import DiskTier, SlotMeta
    from disk_tier.slab import SlabFile
    from remote_tier.mac import Mac
    unit, first = 1 << 16, sys.argv[2] == "first"
    tier = DiskTier(sys.argv[1], 4 << 20, {"kv": unit}, "layout-a", Mac(b"s" * 32))

    def meta(i):
        return SlotMeta(blake3.blake3(str(i).encode()).digest(), b"", 0)

    def rows(ms):
        return np.stack([np.frombuffer(blake3.blake3(m.key).digest(length=unit), np.uint8)
                         for m in ms])

    old = [meta(i) for i in range(4)]
    tier.write("kv", tier.alloc("kv", 4), rows(old), old)
    real = SlabFile.write

    def cut(self, slot, views):  # half of the slot reaches the file, then the process dies
        flat = b"".join(bytes(v) for v in views)
        half = len(flat) // 2 // 4096 * 4096
        where = slot * self.slot_size
        fd = os.open(self.path, os.O_WRONLY)
        if first:
            os.pwrite(fd, flat[:half], where)
        else:
            os.pwrite(fd, flat[half:], where + half)
        os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    SlabFile.write = cut
    tier.free("kv", [0])
    tier.write("kv", tier.alloc("kv", 1), rows([meta(9)]), [meta(9)])
""")


@pytest.mark.parametrize("half", ["first", "last"])
def test_a_write_cut_in_half_by_sigkill_is_a_miss(tmp_path: Path, half: str) -> None:
    """A new slot's first half (its header, part of its body) or only its second half
    reached the file before the writer was killed: the slot is a miss, the others verify."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", CUT, str(tmp_path), half], env=env,
                          capture_output=True, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    tier = DiskTier(tmp_path, 4 << 20, {"kv": 1 << 16}, "layout-a", Mac(SECRET))
    try:
        found = {r.slot: r for r in tier.recovered}
        assert set(found) == {0, 1, 2, 3}  # slot 0's header is the new one or the old one
        rows, ok = tier.read("kv", [0, 1, 2, 3])
        assert ok == [False, True, True, True]
        for s in (1, 2, 3):
            assert np.array_equal(rows[s], body(found[s].meta.key, 1 << 16))
    finally:
        tier.close()


def test_a_clean_close_checkpoints_the_index_and_a_bad_one_means_a_scan(tmp_path: Path
                                                                         ) -> None:
    with open_tier(tmp_path) as tier:
        fill(tier, "kv", 0, 5)
        fill(tier, "state", 10, 2)
    index = tmp_path / "index.bin"
    assert index.exists()
    with open_tier(tmp_path) as tier:  # from the index: the same slots a scan finds
        assert not index.exists()  # taken: a crash from here on scans
        assert tier.snapshot()["restart"] == "index"
        by_index = sorted((r.kind, r.slot, r.meta) for r in tier.recovered)
        assert len(by_index) == 7 and all(tier.read(k, [s])[1] == [True]
                                          for k, s, _ in by_index)
    index.unlink()
    with open_tier(tmp_path) as tier:
        assert tier.snapshot()["restart"] == "scan"
        assert sorted((r.kind, r.slot, r.meta) for r in tier.recovered) == by_index
    raw = bytearray(index.read_bytes())
    raw[40] ^= 1  # a forged row
    index.write_bytes(bytes(raw))
    with open_tier(tmp_path) as tier:
        assert tier.snapshot()["restart"] == "scan" and len(tier.recovered) == 7
