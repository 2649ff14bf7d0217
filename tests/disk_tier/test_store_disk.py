"""The disk tier inside TierStore: demotion down L1 -> L2 -> disk -> L3, promotion, restart."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from remote_tier import RemoteTierConfig
from tierstore.config import StoreConfig
from tierstore.layout import layout_from_config
from tierstore.radix import Tier
from tierstore.store import TierStore

PAGE = 4
HYBRID = {  # full attention + SWA + recurrent: every match rule applies
    "name": "t-hybrid", "torch_dtype": "float32", "num_key_value_heads": 1, "head_dim": 16,
    "sliding_window": 8, "linear_num_key_heads": 1, "linear_key_head_dim": 4,
    "linear_num_value_heads": 1, "linear_value_head_dim": 4, "linear_conv_kernel_dim": 2,
    "layer_types": ["full_attention", "sliding_attention", "linear_attention"],
}
LAYOUT = layout_from_config(HYBRID, page_size=PAGE)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}
PREFIX = 16  # tokens: 4 pages, an SWA window of 2 pages, one checkpoint
ONE = 4 * UNITS["kv"] + 2 * UNITS["swa"] + UNITS["state"]
SECRET = b"k" * 32


def make(disk: Path, *, l1: int = 1, l2: int = 0, disk_bytes: int = 4 << 20,
         redis_url: str | None = None, secret: bytes = SECRET, **kw: object) -> TierStore:
    remote = RemoteTierConfig(url=redis_url, key_prefix="dsk", op_timeout_s=0.5,
                              breaker_cooldown_s=0.2, mac_key=secret) if redis_url else None
    cfg = StoreConfig(capacity_bytes=l1 * ONE + 512,
                      host_capacity_bytes=l2 * ONE + 512 if l2 else 0, remote=remote,
                      disk_path=str(disk), disk_size_bytes=disk_bytes, disk_mac_key=secret,
                      **kw)  # type: ignore[arg-type]
    return TierStore(LAYOUT, cfg)


def envelopes(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (4, UNITS["kv"]), dtype=torch.uint8, generator=g),
            "swa": torch.randint(0, 256, (2, UNITS["swa"]), dtype=torch.uint8, generator=g),
            "state": torch.randint(0, 256, (UNITS["state"],), dtype=torch.uint8, generator=g)}


def tokens(i: int) -> list[int]:
    return list(range(100 * i, 100 * i + PREFIX))


def served(s: TierStore, i: int, data: dict[str, torch.Tensor]) -> dict[str, int]:
    """Match prefix i; it must come back whole and byte for byte; its tokens per tier."""
    m = s.match(tokens(i) + [7])
    assert m.tokens == PREFIX, f"prefix {i}: {m.tokens} tokens"
    assert torch.equal(s.arena.read("kv", m.kv), data["kv"])
    assert torch.equal(s.arena.read("swa", m.swa[2:]), data["swa"])
    assert torch.equal(s.arena.read("state", [m.state])[0], data["state"])
    s.release(m.lease)  # type: ignore[arg-type]
    check(s)
    return dict(m.tiers)


def check(s: TierStore) -> None:
    """The store's integrity, and the index naming exactly the slots the disk holds."""
    s.check_integrity()
    assert s.disk is not None
    for kind in s.kinds:
        named = [n.entry(Tier.DISK, kind, j) for n in s.index.nodes()
                 for j in (range(1) if kind == "state" else range(len(n.keys)))]
        named = [v for v in named if v >= 0]
        assert len(named) == len(set(named)) == s.disk.tier.used(kind), kind


def test_l1_evictions_go_to_disk_and_hit_from_there(tmp_path: Path) -> None:
    with make(tmp_path) as s:
        data = {i: envelopes(i) for i in range(4)}
        for i, d in data.items():
            assert s.insert(tokens(i), **d).stored
        check(s)
        assert s.disk is not None and s.disk.tier.used("kv") == 12  # 3 prefixes went down
        tiers = served(s, 0, data[0])
        assert tiers == {"l1": 0, "l2": 0, "l3": 0, "disk": PREFIX}
        stats = s.stats()
        assert stats.hit_tokens["disk"] == PREFIX and stats.hit_requests["disk"] == 1
        assert stats.moved_bytes["disk_to_l1"] == ONE
        assert stats.disk is not None and stats.disk["reads"] == 7
        for i in (1, 2, 3, 0):
            served(s, i, data[i])


def test_the_chain_l1_l2_disk(tmp_path: Path) -> None:
    with make(tmp_path, l1=1, l2=1) as s:
        data = {i: envelopes(i) for i in range(5)}
        for i, d in data.items():
            assert s.insert(tokens(i), **d).stored
        stats = s.stats()
        assert stats.moved_bytes["l1_to_l2"] == 4 * ONE
        assert stats.moved_bytes["l2_to_disk"] == 3 * ONE
        assert served(s, 3, data[3])["l2"] == PREFIX
        assert served(s, 0, data[0])["disk"] == PREFIX
        for i in range(5):
            served(s, i, data[i])


def test_a_full_disk_evicts_its_oldest_and_write_through_fills_it(tmp_path: Path) -> None:
    with make(tmp_path, disk_bytes=200_000, write_policy="write_through") as s:
        assert s.disk is not None
        slots = s.disk.tier.nslots["kv"] // 4  # prefixes the disk holds
        data = {i: envelopes(i) for i in range(slots + 2)}
        for i, d in data.items():
            assert s.insert(tokens(i), **d).stored
            check(s)
        assert s.peek(tokens(0), tiers=(1, 2, 3, 4)) == 0  # the oldest left every tier
        last = max(data)
        assert served(s, last, data[last])["l1"] == PREFIX
        assert served(s, last - 1, data[last - 1])["disk"] == PREFIX


def test_disk_evictions_demote_to_l3(tmp_path: Path, redis_url: str) -> None:
    with make(tmp_path, disk_bytes=200_000, redis_url=redis_url) as s:
        assert s.disk is not None
        data = {i: envelopes(i) for i in range(s.disk.tier.nslots["kv"] // 4 + 3)}
        for i, d in data.items():
            assert s.insert(tokens(i), **d).stored
        assert s.stats().moved_bytes["disk_to_l3"] >= ONE
        assert served(s, 0, data[0])["l3"] == PREFIX
        for i in data:
            served(s, i, data[i])


KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from test_store_disk import envelopes, make, tokens
    from pathlib import Path
    s = make(Path(sys.argv[1]), l1=1)
    for i in range(4):
        s.insert(tokens(i), **envelopes(i))
    s.demote_idle(0)  # what L1 still holds goes down too
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush
""")


def test_warm_restart_after_sigkill_hits_from_disk_byte_exact(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    here = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path), here], env=env,
                          capture_output=True, check=False)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    with make(tmp_path) as s:
        assert s.disk is not None and s.disk.tier.stats.recovered == 4 * 7
        check(s)
        for i in range(4):  # the first repeat of each prompt hits from disk
            assert served(s, i, envelopes(i))["disk"] == PREFIX
    with make(tmp_path, secret=b"x" * 32) as s:  # another secret: misses, never bytes
        assert s.match(tokens(0) + [7]).tokens == 0
        check(s)


def test_a_forged_slot_after_restart_is_a_miss(tmp_path: Path) -> None:
    with make(tmp_path) as s:
        for i in range(3):
            s.insert(tokens(i), **envelopes(i))
        s.demote_idle(0)
    raw = bytearray((tmp_path / "kv.slab").read_bytes())
    raw[600] ^= 0xFF  # a body byte of slot 0 (the first page of some prefix)
    (tmp_path / "kv.slab").write_bytes(bytes(raw))
    with make(tmp_path) as s:
        hits = 0
        for i in range(3):
            m = s.match(tokens(i) + [7])
            if m.tokens:
                hits += 1
                assert torch.equal(s.arena.read("kv", m.kv), envelopes(i)["kv"])
                s.release(m.lease)  # type: ignore[arg-type]
        assert hits == 2
        assert s.disk is not None and s.disk.tier.stats.misses == 1
        check(s)


@pytest.fixture
def redis_url(redis_server) -> str:  # type: ignore[no-untyped-def]
    """The session server, emptied for this test."""
    redis_server.command("FLUSHALL")
    return str(redis_server.url)
