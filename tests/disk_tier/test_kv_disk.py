"""The storage API's values on the disk tier: ``DiskValues`` alone (chunks, LRU, restart,
torn and forged chunks), then through a real service (HTTP and shared memory), including a
service SIGKILLed after its writes and one restarted cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from host_tier import shm
from remote_tier.mac import Mac
from tierstore.client import Client
from tierstore.config import StoreConfig
from tierstore.service import kv_disk
from tierstore.service.config import ServiceConfig
from tierstore.service.kv_disk import DiskValues, digest
from tierstore.shm_client import SharedMemoryTransport
from tierstore.store import TierStore
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

SECRET = b"k" * 32
CHUNK = 8 << 10
NS = "disk-kv"
SLOT = CHUNK + 4096  # a chunk's slot: header block + body, aligned


def data(n: int, size: int, seed: int) -> list[bytes]:
    g = np.random.default_rng(seed)
    return [g.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def opened(where: Path, size: int = 32 * SLOT, secret: bytes = SECRET) -> DiskValues:
    return DiskValues(where, size, Mac(secret), chunk_bytes=CHUNK, io_threads=2)


def read(disk: DiskValues, keys: list[str]) -> list[bytes | None]:
    lengths = [disk.length(digest(k)) for k in keys]
    targets = [None if n is None else np.empty(n, np.uint8) for n in lengths]
    got = disk.get_into([digest(k) for k in keys], targets)
    return [t.tobytes() if ok and t is not None else None
            for ok, t in zip(got, targets, strict=True)]


def put(disk: DiskValues, keys: list[str], values: list[bytes]) -> list[bool]:
    return disk.put([digest(k) for k in keys], values)


SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17]


# ------------------------------------------------------------------ DiskValues
def test_values_of_any_size_round_trip_and_survive_a_clean_close(tmp_path: Path) -> None:
    values = [data(1, n, seed=n)[0] for n in SIZES]
    keys = [f"v{n}" for n in SIZES]
    with opened(tmp_path) as disk:
        assert put(disk, keys, values) == [True] * len(keys)
        assert read(disk, [*keys, "absent"]) == [*values, None]
        disk.check_integrity()
    with opened(tmp_path) as disk:  # from the checkpointed index
        assert disk.tier.stats.extra["restart"] == "index"
        assert disk.recovered == len(keys)
        assert read(disk, keys) == values
        disk.check_integrity()
    os.unlink(tmp_path / "index.bin")  # as after a crash: the headers are scanned
    with opened(tmp_path) as disk:
        assert disk.tier.stats.extra["restart"] == "scan"
        assert read(disk, keys) == values
        disk.check_integrity()


def test_reads_larger_than_the_staging_buffer_go_in_groups(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(kv_disk, "STAGE_BYTES", 3 * SLOT)
    values = [data(1, n, seed=n + 50)[0] for n in SIZES]  # 1 to 4 chunks each
    keys = [f"g{n}" for n in SIZES]
    with opened(tmp_path) as disk:
        assert put(disk, keys, values) == [True] * len(keys)
        assert read(disk, keys[::-1]) == values[::-1]
        disk.check_integrity()


def test_full_disk_evicts_least_recently_used_values(tmp_path: Path) -> None:
    with opened(tmp_path, size=8 * SLOT) as disk:  # 8 chunks
        values = data(4, 2 * CHUNK, seed=1)
        keys = [f"e{i}" for i in range(4)]
        assert put(disk, keys, values) == [True] * 4
        assert read(disk, ["e0"]) == [values[0]]  # e0 is now the most recent
        assert put(disk, ["new"], data(1, 2 * CHUNK, seed=2)) == [True]
        assert read(disk, keys) == [values[0], None, values[2], values[3]]
        assert put(disk, ["huge"], data(1, 9 * CHUNK, seed=3)) == [False]  # never fits
        assert disk.evictions == 1
        disk.check_integrity()


def test_after_a_crash_the_newest_complete_write_of_a_key_wins(tmp_path: Path) -> None:
    old, new = data(2, 2 * CHUNK + 5, seed=4)
    with opened(tmp_path) as disk:
        assert put(disk, ["k"], [old]) == [True]
        assert put(disk, ["k"], [new]) == [True]  # old's slots are free, its bytes remain
        assert put(disk, ["other"], [old]) == [True]
    os.unlink(tmp_path / "index.bin")
    with opened(tmp_path) as disk:
        assert read(disk, ["k", "other"]) == [new, old]
        disk.check_integrity()


def test_torn_forged_and_foreign_chunks_are_misses(tmp_path: Path) -> None:
    values = data(3, 2 * CHUNK, seed=5)
    keys = ["a", "b", "c"]
    with opened(tmp_path) as disk:
        assert put(disk, keys, values) == [True] * 3
        slots = {k: disk._index[digest(k)].slots for k in keys}
    slab = tmp_path / "kv.slab"
    raw = bytearray(slab.read_bytes())
    raw[slots["a"][1] * SLOT + 4096 + 100] ^= 1  # a body byte of a's second chunk
    raw[slots["b"][1] * SLOT:slots["b"][1] * SLOT + 4096] = bytes(4096)  # b's chunk torn
    slab.write_bytes(bytes(raw))
    with opened(tmp_path) as disk:  # the index names b's torn chunk: its read misses
        assert read(disk, keys) == [None, None, values[2]]
        disk.check_integrity()
        assert disk.tier.stats.misses >= 2
    os.unlink(tmp_path / "index.bin")
    with opened(tmp_path) as disk:  # a scan sees that b is incomplete: it is not found;
        assert digest("b") not in disk  # a's headers are whole: found, and its read misses
        assert read(disk, ["a", "c"]) == [None, values[2]]
    with opened(tmp_path, secret=b"x" * 32) as disk:  # another deployment's key
        assert read(disk, ["c"]) == [None]
        disk.check_integrity()


# ------------------------------------------------------------------ through the service
def serve(where: Path, *, host: int = 64 << 10, shm_on: bool = False) -> RunningService:
    store = TierStore(tiny_layout(page_size=4), StoreConfig(capacity_bytes=1 << 20))
    config = ServiceConfig(port=free_port(), kv_host_bytes=host, shm=shm_on,
                           kv_disk_path=str(where), kv_disk_bytes=64 * SLOT,
                           kv_disk_chunk_bytes=CHUNK, kv_disk_mac_key=SECRET)
    return RunningService(store, config).start()


def test_http_values_beyond_host_memory_are_read_back_from_disk(tmp_path: Path) -> None:
    keys, values = [f"h{i}" for i in range(12)], data(12, 3 * CHUNK + 100, seed=6)  # 300 KiB
    svc = serve(tmp_path)
    try:
        with Client(svc.url, retries=0) as c:
            assert c.batch_set(keys, values, NS) == [True] * 12
            kv = svc.service.kv
            assert kv.stats()["host_evictions"] > 0  # 64 KiB of host memory: most left it
            assert c.batch_get([*keys, "absent"], NS) == [*values, None]
            assert kv.stats()["hits_disk"] > 0
            assert c.batch_exists(keys, NS) == 12
            assert c.exists_each(["h0", "absent", "h11"], NS) == [True, False, True]
            assert c.delete(["h3"], NS) == 1
            assert c.batch_get(["h3"], NS) == [None]
            assert kv.disk is not None
            kv.disk.check_integrity()
            kv.host.check_integrity()
            assert c.stats()["service"]["kv"]["disk_keys"] == 11
            with urllib.request.urlopen(f"{svc.url}/metrics", timeout=30) as reply:
                assert b"tierstore_kv_disk_bytes " in reply.read()
    finally:
        svc.stop()
    again = serve(tmp_path)  # a clean stop checkpointed the disk copy's index
    try:
        with Client(again.url, retries=0) as c:
            rest = [k for k in keys if k != "h3"]
            assert c.batch_get(rest, NS) == [v for k, v in zip(keys, values, strict=True)
                                             if k != "h3"]
            assert c.batch_get(["h3"], NS) == [None]
            assert again.service.kv.stats()["hits_disk"] == len(rest)
    finally:
        again.stop()


@pytest.mark.skipif(not shm.available(16 << 20), reason="no usable /dev/shm")
def test_shared_memory_commits_are_written_behind_to_disk(tmp_path: Path) -> None:
    keys, values = [f"s{i}" for i in range(6)], data(6, 2 * CHUNK + 1, seed=7)
    svc = serve(tmp_path, host=1 << 20, shm_on=True)
    try:
        with Client(svc.url, retries=0) as c:
            transport = SharedMemoryTransport.attach(c)
            try:
                assert transport.batch_set(keys, values, NS) == [True] * 6
            finally:
                transport.close()
    finally:
        svc.stop()  # waits for the background disk writes
    again = serve(tmp_path, host=1 << 20, shm_on=True)
    try:
        with Client(again.url, retries=0) as c:
            transport = SharedMemoryTransport.attach(c)
            try:  # from disk into the new segment, then mapped by the client
                assert transport.batch_get(keys, NS) == values
            finally:
                transport.close()
        assert again.service.kv.stats()["hits_disk"] == 6
    finally:
        again.stop()


KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from pathlib import Path
    from test_kv_disk import NS, data, serve
    from tierstore.client import Client
    svc = serve(Path(sys.argv[1]))
    with Client(svc.url, retries=0) as c:
        assert c.batch_set([f"x{i}" for i in range(5)], data(5, 20000, seed=8), NS) == [True] * 5
    os.kill(os.getpid(), signal.SIGKILL)  # no close: no index, the next start scans
""")


def test_a_sigkilled_service_s_values_are_found_again(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path),
                           str(Path(__file__).parent)], env=env, capture_output=True,
                          check=False, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not (tmp_path / "index.bin").exists()
    svc = serve(tmp_path)
    try:
        assert svc.service.kv.stats()["disk_recovered"] == 5
        with Client(svc.url, retries=0) as c:
            assert c.batch_get([f"x{i}" for i in range(5)], NS) == data(5, 20000, seed=8)
    finally:
        svc.stop()


def test_a_read_cancelled_while_the_disk_fills_it_gives_its_host_ranges_back(
        tmp_path: Path) -> None:
    import asyncio
    import threading

    from tierstore.service.kv import KeyValueStore

    gate, entered = threading.Event(), threading.Event()

    async def scenario() -> None:
        kv = KeyValueStore(1 << 20, None, shared=False, disk=opened(tmp_path))
        try:
            assert kv.disk is not None
            await kv.batch_set(["a", "b"], data(2, 3 * CHUNK, seed=9))
            assert await kv.drop_host_copies() == 2
            slow = kv.disk.get_into

            def held(*args: object) -> list[bool]:
                entered.set()
                gate.wait(30)
                return slow(*args)  # type: ignore[arg-type]

            kv.disk.get_into = held  # type: ignore[method-assign,assignment]
            task = asyncio.ensure_future(kv.batch_get(["a", "b"]))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, 30)
            task.cancel()  # it waits on the disk thread with two host ranges held
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            await kv._on_disk(lambda: None)  # the disk thread is past the read (FIFO) ...
            await asyncio.sleep(0)  # ... and the loop has run the give-back callback
            kv.disk.get_into = slow  # type: ignore[method-assign]
            assert kv.host.slots.used_bytes == 0  # given back, nothing published
            kv.host.check_integrity()
            assert await kv.batch_get(["a", "b"]) == data(2, 3 * CHUNK, seed=9)
        finally:
            gate.set()
            await kv.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("change", ["put", "delete"])
def test_a_write_or_delete_during_a_disk_read_is_not_undone_by_it(tmp_path: Path,
                                                                 change: str) -> None:
    """A read that found the old value on disk must not publish it into host memory over a
    put (or after a delete) that ran while the disk thread read it."""
    import asyncio
    import threading

    from tierstore.service.kv import KeyValueStore

    gate, entered = threading.Event(), threading.Event()
    old, new = data(2, 3 * CHUNK, seed=11)

    async def scenario() -> None:
        kv = KeyValueStore(1 << 20, None, shared=False, disk=opened(tmp_path))
        try:
            assert kv.disk is not None
            await kv.batch_set(["a"], [old])
            assert await kv.drop_host_copies() == 1
            slow = kv.disk.get_into

            def held(*args: object) -> list[bool]:
                entered.set()
                gate.wait(30)
                return slow(*args)  # type: ignore[arg-type]

            kv.disk.get_into = held  # type: ignore[method-assign,assignment]
            reading = asyncio.ensure_future(kv.batch_get(["a"]))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, 30)
            # The change runs on the loop now; its disk call queues behind the read.
            changing = asyncio.ensure_future(kv.batch_set(["a"], [new]) if change == "put"
                                             else kv.delete(["a"]))
            await asyncio.sleep(0)
            gate.set()
            assert (await reading)[0] in (old, None)  # as of before the change, or a miss
            await changing
            kv.disk.get_into = slow  # type: ignore[method-assign]
            assert await kv.batch_get(["a"]) == [new if change == "put" else None]
            kv.host.check_integrity()
        finally:
            gate.set()
            await kv.aclose()

    asyncio.run(scenario())


def test_a_read_cancelled_during_its_disk_read_unpins_its_host_hits(tmp_path: Path) -> None:
    """The host values a read found (and pinned) before it went to disk are unpinned when it
    is cancelled there: a pin left behind would keep the range from eviction for good."""
    import asyncio
    import threading

    from tierstore.service.kv import KeyValueStore

    gate, entered = threading.Event(), threading.Event()

    async def scenario() -> None:
        kv = KeyValueStore(1 << 20, None, shared=False, disk=opened(tmp_path))
        try:
            assert kv.disk is not None
            await kv.batch_set(["a", "b"], data(2, CHUNK, seed=12))
            await kv.flush()
            assert kv.host.drop_unpinned("b")  # "a" in host memory, "b" only on disk
            slow = kv.disk.get_into

            def held(*args: object) -> list[bool]:
                entered.set()
                gate.wait(30)
                return slow(*args)  # type: ignore[arg-type]

            kv.disk.get_into = held  # type: ignore[method-assign,assignment]
            task = asyncio.ensure_future(kv.batch_get(["a", "b"]))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            value = kv.host.get("a")
            assert value is not None and value.pins == 0
            gate.set()
            await kv._on_disk(lambda: None)
            await asyncio.sleep(0)
            kv.host.check_integrity()
        finally:
            gate.set()
            await kv.aclose()

    asyncio.run(scenario())


def test_a_key_read_twice_in_one_batch_is_read_once(tmp_path: Path) -> None:
    """A key given twice in one read: both get its bytes; when a chunk fails, the value is
    dropped once and its slots freed once (a second free would hand one slot out twice)."""
    values = data(2, 2 * CHUNK, seed=13)
    with opened(tmp_path) as disk:
        assert put(disk, ["a", "b"], values) == [True, True]
        assert read(disk, ["a", "b", "a"]) == [values[0], values[1], values[0]]
        slot = disk._index[digest("a")].slots[1]
    slab = tmp_path / "kv.slab"
    raw = bytearray(slab.read_bytes())
    raw[slot * SLOT + 4096 + 100] ^= 1  # a body byte of a's second chunk
    slab.write_bytes(bytes(raw))
    with opened(tmp_path) as disk:
        assert read(disk, ["a", "b", "a"]) == [None, values[1], None]
        disk.check_integrity()
        assert put(disk, ["c", "d"], data(2, 2 * CHUNK, seed=14)) == [True, True]
        disk.check_integrity()
        assert read(disk, ["b"]) == [values[1]]


def test_a_commit_cancelled_while_its_disk_write_runs_keeps_the_ranges_pinned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that writes to disk before returning (past the write-behind limit) and is
    cancelled meanwhile keeps its values pinned until the disk thread has read them: their
    ranges must not be reused under a write that is still copying them out."""
    import asyncio
    import threading

    from tierstore.service import kv_disk_copy
    from tierstore.service.kv import KeyValueStore

    monkeypatch.setattr(kv_disk_copy, "WRITE_BEHIND_BYTES", 0)
    gate, entered = threading.Event(), threading.Event()
    (value_bytes,) = data(1, 5 * CHUNK, seed=15)  # past half of host memory: not behind

    async def scenario() -> None:
        kv = KeyValueStore(1 << 16, None, shared=False, disk=opened(tmp_path))
        try:
            assert kv.disk is not None
            slow = kv.disk.put

            def held(*args: object) -> list[bool]:
                entered.set()
                gate.wait(30)
                return slow(*args)  # type: ignore[arg-type]

            kv.disk.put = held  # type: ignore[method-assign,assignment]
            res_id, ranges = kv.reserve(["a"], [len(value_bytes)])
            (value,) = ranges
            assert value is not None
            kv.host.tensor(value).numpy()[:] = np.frombuffer(value_bytes, np.uint8)
            task = asyncio.ensure_future(kv.commit(res_id))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert value.pins >= 1  # the disk thread still reads the range
            gate.set()
            await kv._on_disk(lambda: None)
            await asyncio.sleep(0)
            assert value.pins == 0
            kv.disk.put = slow  # type: ignore[method-assign]
            assert kv.host.drop_unpinned("a")
            assert await kv.batch_get(["a"]) == [value_bytes]
            kv.host.check_integrity()
        finally:
            gate.set()
            await kv.aclose()

    asyncio.run(scenario())


def test_a_disk_read_begun_while_a_put_copies_off_the_loop_does_not_undo_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that goes to disk after a put began but before the put's values are in host
    memory (copied by a worker thread) must not publish the older disk bytes over them."""
    import asyncio
    import threading

    from tierstore.service import kv as kv_module
    from tierstore.service.kv import KeyValueStore

    monkeypatch.setattr(kv_module, "COPY_ON_LOOP_BYTES", 0)  # every put copies off the loop
    copy_gate, copying = threading.Event(), threading.Event()
    read_gate, reading_disk = threading.Event(), threading.Event()
    old, new = data(2, 3 * CHUNK, seed=16)
    fill = kv_module._fill

    def held_fill(*args: object) -> None:
        copying.set()
        copy_gate.wait(30)
        fill(*args)  # type: ignore[arg-type]

    async def scenario() -> None:
        kv = KeyValueStore(1 << 20, None, shared=False, disk=opened(tmp_path))
        try:
            assert kv.disk is not None
            await kv.batch_set(["a"], [old])
            assert await kv.drop_host_copies() == 1
            slow = kv.disk.get_into

            def held_get(*args: object) -> list[bool]:
                reading_disk.set()
                read_gate.wait(30)
                return slow(*args)  # type: ignore[arg-type]

            monkeypatch.setattr(kv_module, "_fill", held_fill)
            kv.disk.get_into = held_get  # type: ignore[method-assign,assignment]
            loop = asyncio.get_running_loop()
            putting = asyncio.ensure_future(kv.batch_set(["a"], [new]))
            assert await loop.run_in_executor(None, copying.wait, 30)
            reading = asyncio.ensure_future(kv.batch_get(["a"]))
            assert await loop.run_in_executor(None, reading_disk.wait, 30)
            copy_gate.set()
            while "a" not in kv.host:  # the put has published its value in host memory
                await asyncio.sleep(0.01)
            read_gate.set()
            assert (await reading)[0] in (old, new, None)
            await putting
            kv.disk.get_into = slow  # type: ignore[method-assign]
            assert await kv.batch_get(["a"]) == [new]
            kv.host.check_integrity()
        finally:
            copy_gate.set()
            read_gate.set()
            await kv.aclose()

    asyncio.run(scenario())
