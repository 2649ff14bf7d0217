"""Property: over random workloads (shared prefixes, partial tails, inserts with and without
checkpoints or full SWA, held leases, tiny tiers that evict and drop), every match's hits by
tier plus its losses by reason sum to the prompt length, and the store's totals agree."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.attribution import REASONS
from tierstore.config import StoreConfig
from tierstore.store import TierStore

from .conftest import FULL_ONLY, HYBRID, PAGE, SWA_ONLY, layout

BRANCHES = 3  # token families: prompts of one family share prefixes

ops = st.lists(st.tuples(
    st.sampled_from(["insert", "insert", "match", "match", "hold", "free"]),
    st.integers(0, BRANCHES - 1),  # family
    st.integers(0, 3),  # pages the prompt shares with its family's trunk
    st.integers(0, 5),  # pages of its own
    st.integers(0, PAGE - 1),  # tail tokens
    st.booleans(),  # insert: with a checkpoint
    st.booleans(),  # insert: every SWA page (else only the last)
), min_size=1, max_size=40)


def prompt(family: int, shared: int, own: int, tail: int, salt: int) -> list[int]:
    trunk = [family * 1000 + i for i in range(shared * PAGE)]
    mine = [50_000 + salt * 97 + i for i in range((own * PAGE) + tail)]
    return trunk + mine


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from([HYBRID, SWA_ONLY, FULL_ONLY]),
       l1_pages=st.integers(2, 12), l2_pages=st.sampled_from([0, 4, 16]), steps=ops)
def test_parts_always_sum_to_the_prompt(config: dict, l1_pages: int, l2_pages: int,
                                        steps: list[tuple]) -> None:
    lay = layout(config)
    units = {k: e.nbytes for k, e in lay.envelopes().items()}
    per_page = units["kv"] + units.get("swa", 0)
    state = 2 * units.get("state", 0)
    s = TierStore(lay, StoreConfig(capacity_bytes=l1_pages * per_page + state + 256,
                                   host_capacity_bytes=l2_pages * per_page + state if l2_pages
                                   else 0))
    held = []
    queried = hit = 0
    for n, (op, family, shared, own, tail, checkpoint, all_swa) in enumerate(steps):
        toks = prompt(family, shared, own, tail, salt=n % 4)
        if op == "insert":
            pages = len(toks) // PAGE
            if not pages:
                continue
            toks = toks[: pages * PAGE]
            given_: dict[str, torch.Tensor] = {
                "kv": torch.full((pages, units["kv"]), n % 251, dtype=torch.uint8)}
            if "swa" in units:
                rows = pages if all_swa else 1
                given_["swa"] = torch.full((rows, units["swa"]), 7, dtype=torch.uint8)
            if "state" in units and checkpoint:
                given_["state"] = torch.full((units["state"],), 3, dtype=torch.uint8)
            s.insert(toks, **given_)  # may not fit: stored=False changes nothing
        elif op == "free":
            while held:
                s.release(held.pop())
        else:
            m = s.match(toks)
            assert set(m.lost) <= set(REASONS)
            assert sum(m.tiers.values()) == m.tokens
            assert m.tokens + sum(m.lost.values()) == len(toks), (m.tiers, m.lost, len(toks))
            assert sum(m.evicted_from.values()) == m.lost.get("evicted", 0)
            assert m.lost.get("partial_page", 0) == len(toks) % PAGE
            queried += len(toks)
            hit += m.tokens
            if m.lease is not None:
                if op == "hold":
                    held.append(m.lease)
                else:
                    s.release(m.lease)
    s.check_integrity()
    snap = s.stats().attribution
    assert snap is not None
    assert sum(snap["hit"].values()) == hit  # type: ignore[attr-defined]
    assert sum(snap["lost"].values()) == queried - hit  # type: ignore[attr-defined]
