"""``tierstore serve --disk``: the service's store gets the disk tier, its metrics a disk row,
and a second service on the same directory (and key file) finds the cached prefixes."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch

from tierstore.service import server
from tierstore.service.metrics import StoreCollector


def build(tmp_path: Path, stack: contextlib.ExitStack) -> object:
    key = tmp_path / "mac.key"
    if not key.exists():
        key.write_bytes(b"d" * 40)
        key.chmod(0o600)
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--no-redis", "--device", "cpu", "--l1", "1MiB", "--l2", "0",
                              "--scale", "1/2048", "--no-shm", "--mac-key-file", str(key),
                              "--disk", str(tmp_path / "disk"), "--disk-size", "16MiB"])
    service, _ = server.build(args, stack)
    stack.callback(service.store.close)
    stack.callback(service.kv.close)
    return service


def test_serve_disk_keeps_prefixes_across_a_restart(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        store = build(tmp_path, stack).store  # type: ignore[attr-defined]
        assert store.disk is not None
        units = store._units
        page = store.layout.page_size
        tokens = list(range(4 * page))
        data = {k: torch.randint(0, 256, (4 if k != "state" else 1, units[k]),
                                 dtype=torch.uint8) for k in store.kinds}
        given = {k: (v[0] if k == "state" else v) for k, v in data.items()}
        assert store.insert(tokens, **given).stored
        store.demote_idle(0)
        stats = store.stats()
        assert stats.disk["used"]["kv"] == 4
        collector = StoreCollector()
        collector.snapshot = stats
        names = {m.name for m in collector.collect()}
        assert {"tierstore_disk_bytes", "tierstore_disk_slots"} <= names
    with contextlib.ExitStack() as stack:
        store = build(tmp_path, stack).store  # type: ignore[attr-defined]
        m = store.match(tokens + [1])
        assert m.tokens == 4 * page and m.tiers["disk"] == 4 * page
        assert torch.equal(store.arena.read("kv", m.kv), data["kv"])
        store.release(m.lease)
