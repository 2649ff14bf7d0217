"""L1 -> L2 -> L3 demotion and promotion through TierStore, with a real redis-server."""

from __future__ import annotations

import time

import pytest
import torch

from remote_tier import RemoteTierConfig
from tierstore.config import StoreConfig
from tierstore.store import TierStore

from .conftest import HYBRID, PAGE, layout

LAYOUT = layout(HYBRID)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}
PREFIX = 16  # tokens: 4 pages, SWA window of 2 pages, one checkpoint
ONE = 4 * UNITS["kv"] + 2 * UNITS["swa"] + UNITS["state"]  # bytes one prefix holds


def make(redis_url: str | None = None, *, l1: int = 1, l2: int = 0, **kwargs: object
         ) -> TierStore:
    """A store whose L1 holds ``l1`` prefixes and L2 ``l2`` prefixes (plus some slack)."""
    remote = RemoteTierConfig(url=redis_url, key_prefix="tst", op_timeout_s=0.5,
                              breaker_cooldown_s=0.2) if redis_url else None
    cfg = StoreConfig(capacity_bytes=l1 * ONE + 512, host_capacity_bytes=l2 * ONE + 512 if l2
                      else 0, remote=remote, **kwargs)  # type: ignore[arg-type]
    return TierStore(LAYOUT, cfg)


def envelopes(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (4, UNITS["kv"]), dtype=torch.uint8, generator=g),
            "swa": torch.randint(0, 256, (2, UNITS["swa"]), dtype=torch.uint8, generator=g),
            "state": torch.randint(0, 256, (UNITS["state"],), dtype=torch.uint8, generator=g)}


def tokens(i: int) -> list[int]:
    return list(range(100 * i, 100 * i + PREFIX))


def put(s: TierStore, i: int) -> dict[str, torch.Tensor]:
    data = envelopes(i)
    assert s.insert(tokens(i), **data).stored
    return data


def assert_served(s: TierStore, i: int, data: dict[str, torch.Tensor]) -> None:
    """A match of prefix i comes back whole, in L1, byte for byte."""
    m = s.match(tokens(i) + [7])
    assert m.tokens == PREFIX, f"prefix {i}: {m.tokens} tokens"
    assert torch.equal(s.arena.read("kv", m.kv), data["kv"])
    assert torch.equal(s.arena.read("swa", m.swa[2:]), data["swa"])
    assert torch.equal(s.arena.read("state", [m.state])[0], data["state"])
    s.release(m.lease)  # type: ignore[arg-type]
    s.check_integrity()


def test_l2_demotes_on_eviction_and_promotes_on_match() -> None:
    s = make(l1=1, l2=3)
    a = put(s, 1)
    b = put(s, 2)  # evicts prefix 1 from L1: it moves to L2
    assert s.peek(tokens(1) + [7]) == 0 and s.peek(tokens(1) + [7], tiers=(2,)) == PREFIX
    assert_served(s, 1, a)  # promoted back, evicting prefix 2 to L2
    assert_served(s, 2, b)
    st = s.stats()
    assert st.hit_tokens["l2"] == 2 * PREFIX and st.hit_requests["l2"] == 2
    assert st.moved_bytes["l1_to_l2"] >= 2 * ONE - UNITS["state"]
    assert st.moved_bytes["l2_to_l1"] >= 2 * (4 * UNITS["kv"])


def test_without_tiers_eviction_drops() -> None:
    s = make(l1=1)
    put(s, 1)
    put(s, 2)
    assert s.match(tokens(1) + [7]).tokens == 0
    assert s.stats().hit_requests["miss"] == 1


def test_l3_round_trip_of_every_kind(redis_url: str) -> None:
    s = make(redis_url, l1=1)
    a = put(s, 1)
    put(s, 2)  # prefix 1 goes straight to Redis (no host tier)
    assert s.peek(tokens(1) + [7], tiers=(3,)) == PREFIX
    assert_served(s, 1, a)
    st = s.stats()
    assert st.hit_tokens["l3"] == PREFIX and st.moved_bytes["l1_to_l3"] >= ONE
    s.close()


def test_chain_l1_l2_l3(redis_url: str) -> None:
    s = make(redis_url, l1=1, l2=1)
    data = {i: put(s, i) for i in range(1, 5)}  # 1, 2 pushed through L2 into L3
    assert s.peek(tokens(1) + [7], tiers=(1, 2)) == 0
    for i in range(1, 5):
        assert_served(s, i, data[i])
    assert s.stats().hit_requests["l3"] >= 2
    s.close()


def test_another_instance_finds_pages_in_redis(redis_url: str) -> None:
    first = make(redis_url, l1=2, write_policy="write_through")
    a = put(first, 1)
    first.close()
    second = make(redis_url, l1=2)  # knows nothing locally: discovers through L3
    assert_served(second, 1, a)
    assert second.match(tokens(1) + [7], namespace="other").tokens == 0
    second.close()


def test_best_effort_discovers_another_instances_pages_in_the_background(
    redis_url: str,
) -> None:
    first = make(redis_url, l1=2, write_policy="write_through")
    a = put(first, 1)
    first.close()
    second = make(redis_url, l1=2, l2=2, prefetch="best_effort")
    query = tokens(1) + [7]
    assert second.match(query).tokens == 0  # never waits on Redis: a miss this time
    deadline = time.monotonic() + 5
    while second.peek(query, tiers=(1, 2)) < PREFIX:  # the probe lands, then the prefetch
        assert time.monotonic() < deadline, "background discovery + prefetch never landed"
        m = second.match(query)  # files what arrived, starts the next step
        if m.tokens:
            second.release(m.lease)  # type: ignore[arg-type]
            break
        time.sleep(0.02)
    assert second.peek(query, tiers=(3,)) == PREFIX  # known in L3 now
    assert_served(second, 1, a)
    assert second.stats().hit_requests["l3"] == 0, "best_effort must never serve from L3"
    second.close()


def test_namespaces_never_see_each_other_in_redis(redis_url: str) -> None:
    s = make(redis_url, l1=2, write_policy="write_through")
    s.insert(tokens(1), "tenant-a", **envelopes(1))
    other = make(redis_url, l1=2)
    assert other.match(tokens(1) + [7], "tenant-b").tokens == 0
    assert other.match(tokens(1) + [7], "tenant-a").tokens == PREFIX
    s.close()
    other.close()


def test_write_through_selective_backs_up_after_n_hits(redis_url: str) -> None:
    s = make(redis_url, l1=2, l2=2, write_policy="write_through_selective",
             write_through_hits=2)
    put(s, 1)
    assert s.peek(tokens(1) + [7], tiers=(2,)) == 0
    s.release(s.match(tokens(1) + [7]).lease)  # type: ignore[arg-type]
    assert s.peek(tokens(1) + [7], tiers=(2,)) == 0
    s.release(s.match(tokens(1) + [7]).lease)  # type: ignore[arg-type]
    assert s.peek(tokens(1) + [7], tiers=(2,)) == PREFIX
    assert s.peek(tokens(1) + [7], tiers=(3,)) == PREFIX
    s.close()


def test_corrupt_value_is_a_miss_and_deleted(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    s = make(redis_url, l1=1)
    put(s, 1)
    put(s, 2)  # prefix 1 now only in Redis
    keys = redis_server.command("KEYS", "tst:*:kv").decode().split()
    assert keys
    victim = next(k for k in keys if k.startswith("tst:"))
    redis_server.command("SETRANGE", victim, "40", "garbage")
    m = s.match(tokens(1) + [7])
    assert m.tokens < PREFIX  # never wrong bytes: the damaged page is a miss
    assert redis_server.command("EXISTS", victim).strip() in (b":0", b"0")
    s.check_integrity()
    s.close()


def test_redis_down_keeps_serving_l1_l2_and_recovers(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    s = make(redis_url, l1=1, l2=1)
    d1, d2 = put(s, 1), put(s, 2)
    put(s, 3)  # 1 -> L3, 2 -> L2, 3 in L1
    redis_server.kill()
    try:
        assert_served(s, 3, envelopes(3))  # L1
        assert_served(s, 2, d2)  # L2
        started = time.perf_counter()
        assert s.match(tokens(1) + [7]).tokens == 0  # in Redis, which is down: a miss
        assert time.perf_counter() - started < 5
        assert s.stats().remote["errors"]  # type: ignore[index]
    finally:
        redis_server.restart()
    deadline = time.monotonic() + 5  # the breaker backs off; it must close again by itself
    while not s.remote.ping():  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "L3 did not recover within 5 s"
        time.sleep(0.05)
    s.insert(tokens(1), **d1)  # recompute-and-insert, as an engine would
    put(s, 4)
    put(s, 5)  # 1 is pushed down to Redis again
    assert_served(s, 1, d1)
    s.close()


@pytest.mark.parametrize("policy", ["timeout", "best_effort"])
def test_prefetch_policies_never_block_on_a_stalled_redis(redis_url: str, redis_server,  # type: ignore[no-untyped-def]
                                                          policy: str) -> None:
    s = make(redis_url, l1=1, prefetch=policy, prefetch_timeout_s=0.05)
    a = put(s, 1)
    put(s, 2)  # 1 -> L3
    redis_server.pause()
    try:
        started = time.perf_counter()
        m = s.match(tokens(1) + [7])
        elapsed = time.perf_counter() - started
    finally:
        redis_server.resume()
    assert m.tokens == 0 and elapsed < 1.0
    deadline = time.monotonic() + 5
    while not s.remote.ping():  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "L3 did not recover within 5 s"
        time.sleep(0.05)
    if policy == "best_effort":  # the prefetch started by the first match lands meanwhile
        prefetch = s.mover.prefetch
        assert prefetch is not None
        while prefetch.pending:
            assert time.monotonic() < deadline, "prefetch never arrived"
            s.peek(tokens(1))
            prefetch.pump()
            time.sleep(0.02)
    assert_served(s, 1, a)  # Redis is back: the same request hits
    s.close()


def test_idle_prefixes_are_demoted_proactively() -> None:
    s = make(l1=3, l2=3)
    a, b = put(s, 1), put(s, 2)
    time.sleep(0.15)
    put(s, 3)  # recent
    assert s.demote_idle(0.1) == 2
    assert s.peek(tokens(1) + [7]) == 0 and s.peek(tokens(2) + [7]) == 0
    assert s.peek(tokens(3) + [7]) == PREFIX
    assert s.peek(tokens(1) + [7], tiers=(2,)) == PREFIX
    assert_served(s, 1, a)
    assert_served(s, 2, b)


def test_multi_turn_conversations_keep_hitting_through_tiers(redis_url: str) -> None:
    """Regression: a node whose children already left L1 must itself stay evictable, or L1
    fills with such parents and every later allocation fails."""
    s = make(redis_url, l1=4, l2=6)  # L1 fits one conversation's longest turn, not all 7
    convs = [tokens(i) for i in range(1, 8)]
    g = torch.Generator().manual_seed(5)
    for turn in range(4):
        for conv in convs:
            m = s.match([*conv, 7])
            if turn:
                assert m.tokens == len(conv), f"turn {turn}: {m.tokens} of {len(conv)}"
            if m.lease is not None:
                s.release(m.lease)
            conv += list(range(conv[-1] + 1, conv[-1] + 9))
            pages = len(conv) // PAGE
            data = {k: torch.randint(0, 256, (n, UNITS[k]), dtype=torch.uint8, generator=g)
                    for k, n in (("kv", pages), ("swa", 2), ("state", 1))}
            assert s.insert(conv, **data).stored
        s.check_integrity()
    st = s.stats()
    assert st.hit_requests["l2"] and st.hit_requests["l3"]
    s.close()
