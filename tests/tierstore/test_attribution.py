"""Miss attribution: each reason on the path that produces it, the ghost index, the stats
totals and the near-zero-hit warning. Every match's parts sum to its prompt length."""

from __future__ import annotations

import logging

import pytest
import torch

from tierstore.attribution import REASONS, Attribution, default_tenant
from tierstore.results import MatchResult
from tierstore.store import TierStore

from .conftest import FULL_ONLY, HYBRID, PAGE, SWA_ONLY, layout, store
from .test_tiers import PREFIX, envelopes, make, put, tokens


def parts(m: MatchResult, n: int) -> dict[str, int]:
    """The match's split, checked to sum to ``n`` tokens and to agree with itself."""
    assert set(m.lost) <= set(REASONS), m.lost
    assert all(v > 0 for v in m.lost.values()), m.lost
    assert sum(m.tiers.values()) == m.tokens
    assert sum(m.tiers.values()) + sum(m.lost.values()) == n, (m.tiers, m.lost, n)
    assert sum(m.evicted_from.values()) == m.lost.get("evicted", 0)
    return m.lost


def release(s: TierStore, m: MatchResult) -> None:
    if m.lease is not None:
        s.release(m.lease)


def test_cold_and_partial_page() -> None:
    s = store()
    m = s.match(list(range(4 * PAGE + 3)))
    assert parts(m, 4 * PAGE + 3) == {"cold": 4 * PAGE, "partial_page": 3}
    short = s.match([1, 2])
    assert parts(short, 2) == {"partial_page": 2}


def test_a_hit_loses_only_what_follows_it() -> None:
    s = make(l1=2)
    put(s, 1)
    m = s.match(tokens(1) + list(range(900, 900 + 2 * PAGE + 1)))
    assert m.tokens == PREFIX and m.tiers["l1"] == PREFIX
    assert parts(m, PREFIX + 2 * PAGE + 1) == {"cold": 2 * PAGE, "partial_page": 1}
    release(s, m)


def test_evicted_from_l1_without_lower_tiers() -> None:
    s = make(l1=1)
    put(s, 1)
    put(s, 2)  # drops prefix 1
    m = s.match(tokens(1) + [7])
    assert parts(m, PREFIX + 1) == {"evicted": PREFIX, "partial_page": 1}
    assert m.evicted_from == {"l1": PREFIX}


def test_evicted_from_l2() -> None:
    s = make(l1=1, l2=1)
    put(s, 1)
    put(s, 2)  # 1 -> L2
    put(s, 3)  # 2 -> L2, which drops 1
    m = s.match(tokens(1) + [7])
    assert parts(m, PREFIX + 1) == {"evicted": PREFIX, "partial_page": 1}
    assert m.evicted_from == {"l2": PREFIX}
    m2 = s.match(tokens(2) + [7])  # still in L2: promoted
    assert m2.tiers["l2"] == PREFIX and parts(m2, PREFIX + 1) == {"partial_page": 1}
    release(s, m2)


def test_no_checkpoint_where_prompts_share_less_than_a_checkpointed_prefix() -> None:
    s = store()
    data = envelopes(1)
    assert s.insert(tokens(1), **data).stored  # checkpoint at page 4 only
    shared = tokens(1)[: 2 * PAGE] + list(range(5000, 5000 + 2 * PAGE))
    m = s.match(shared)
    assert m.kv_pages_found == 2
    assert parts(m, 4 * PAGE) == {"no_checkpoint": 2 * PAGE, "cold": 2 * PAGE}
    text_before = s.attribution.snapshot()["lost"]
    assert text_before["no_checkpoint"] == 2 * PAGE  # type: ignore[index]


def test_swa_window_when_the_window_before_the_checkpoint_is_incomplete() -> None:
    s = store()
    data = envelopes(1)
    assert s.insert(tokens(1), kv=data["kv"], swa=data["swa"][1:], state=data["state"]).stored
    m = s.match(tokens(1) + [7])  # the checkpoint is there, one of its 2 window pages not
    assert m.tokens == 0
    assert parts(m, PREFIX + 1) == {"swa_window": PREFIX, "partial_page": 1}


def test_swa_only_layout_cuts_at_the_window() -> None:
    s = store(SWA_ONLY)
    units = {k: e.nbytes for k, e in s.layout.envelopes().items()}
    kv = torch.zeros(4, units["kv"], dtype=torch.uint8)
    swa = torch.zeros(1, units["swa"], dtype=torch.uint8)  # only the last page's window
    assert s.insert(tokens(1), kv=kv, swa=swa).stored
    m = s.match(tokens(1))
    assert parts(m, PREFIX)["swa_window"] > 0
    release(s, m)


def test_full_attention_only_never_blames_the_rule() -> None:
    s = store(FULL_ONLY)
    units = {k: e.nbytes for k, e in s.layout.envelopes().items()}
    assert s.insert(tokens(1), kv=torch.zeros(4, units["kv"], dtype=torch.uint8)).stored
    m = s.match(tokens(1)[: 3 * PAGE] + [1, 2, 3, 4, 5])
    assert m.tokens == 3 * PAGE and parts(m, 3 * PAGE + 5) == {"cold": PAGE,
                                                               "partial_page": 1}
    release(s, m)


def test_no_room_when_l1_is_held_by_leases() -> None:
    s = make(l1=1, l2=3)
    put(s, 1)
    put(s, 2)  # 1 -> L2
    held = s.match(tokens(2) + [7])  # its lease pins L1
    assert held.tokens == PREFIX
    m = s.match(tokens(1) + [7])
    assert m.tokens == 0
    assert parts(m, PREFIX + 1) == {"no_room": PREFIX, "partial_page": 1}
    release(s, held)


def test_l3_unavailable_while_redis_stalls(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    s = make(redis_url, l1=1, prefetch="timeout", prefetch_timeout_s=0.05)
    put(s, 1)
    put(s, 2)  # 1 -> L3
    redis_server.pause()
    try:
        m = s.match(tokens(1) + [7])
    finally:
        redis_server.resume()
    assert parts(m, PREFIX + 1) == {"l3_unavailable": PREFIX, "partial_page": 1}
    s.close()


def test_evicted_by_l3_when_redis_lost_the_pages(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    s = make(redis_url, l1=1)
    put(s, 1)
    put(s, 2)  # 1 -> L3
    redis_server.command("FLUSHALL")  # Redis's own eviction, as far as the store can tell
    m = s.match(tokens(1) + [7])
    assert parts(m, PREFIX + 1) == {"evicted": PREFIX, "partial_page": 1}
    assert m.evicted_from == {"l3": PREFIX}
    again = s.match(tokens(1) + [7])  # now the index knows L3 lost them
    assert parts(again, PREFIX + 1) == {"evicted": PREFIX, "partial_page": 1}
    s.close()


def test_best_effort_counts_what_it_did_not_wait_for(redis_url: str) -> None:
    s = make(redis_url, l1=1, prefetch="best_effort")
    put(s, 1)
    put(s, 2)  # 1 -> L3
    m = s.match(tokens(1) + [7])
    assert parts(m, PREFIX + 1) == {"l3_unavailable": PREFIX, "partial_page": 1}
    s.close()


def test_stats_totals_match_the_results() -> None:
    s = make(l1=1, l2=1)
    total = {"hit": 0, "lost": 0}
    queried = 0
    for i in (1, 2, 3):
        put(s, i)
    for i in (3, 2, 1, 9):
        m = s.match(tokens(i) + [7, 7])
        queried += PREFIX + 2
        total["hit"] += m.tokens
        total["lost"] += sum(m.lost.values())
        release(s, m)
    snap = s.stats().attribution
    assert snap is not None
    hit, lost = snap["hit"], snap["lost"]
    assert sum(hit.values()) == total["hit"] == s.stats().tokens_hit  # type: ignore[attr-defined]
    assert sum(lost.values()) == total["lost"]  # type: ignore[attr-defined]
    assert total["hit"] + total["lost"] == queried == s.stats().tokens_queried
    assert snap["tenants"]["default"]["lost"]["evicted"] == PREFIX  # type: ignore[index]


def test_tenant_of_a_scoped_namespace() -> None:
    assert default_tenant("alpha|chat") == "alpha"
    assert default_tenant("chat") == "default"


def test_near_zero_hits_with_shared_prefixes_warn_with_the_histogram(
        caplog: pytest.LogCaptureFixture) -> None:
    s = store()
    s.attribution = Attribution(s.layout, window=8, warn_every_s=0.0)
    s.mover.on_drop = s.attribution.on_drop
    data = envelopes(1)
    long = list(range(16 * PAGE))  # checkpoint every 16 pages: at 64 tokens
    units = {k: e.nbytes for k, e in s.layout.envelopes().items()}
    kv = torch.zeros(16, units["kv"], dtype=torch.uint8)
    assert s.insert(long, kv=kv, swa=torch.zeros(2, units["swa"], dtype=torch.uint8),
                    state=data["state"]).stored
    with caplog.at_level(logging.WARNING, logger="tierstore.attribution"):
        for i in range(8):  # each shares 6 pages (24 tokens), then goes its own way
            m = s.match(long[: 6 * PAGE] + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8)))
            assert m.tokens == 0
    assert s.attribution.warnings == 1
    text = caplog.records[-1].getMessage()
    assert "100% of lost tokens: no_checkpoint" not in text  # cold tails share the loss
    assert "no_checkpoint — prompts share a median 24 tokens of cached KV, the nearest " \
           "checkpoint lies at 64" in text, text
    assert "cold" in text


def test_layouts_of_every_kind_sum(hybrid: TierStore) -> None:
    for config in (HYBRID, SWA_ONLY, FULL_ONLY):
        s = TierStore(layout(config), hybrid.config)
        for n in (0, 1, PAGE, 3 * PAGE + 1):
            parts(s.match(list(range(n))), n)
