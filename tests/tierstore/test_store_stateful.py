"""Stateful test of the store's incremental eviction structure against a brute-force oracle.

Hypothesis drives random inserts (shared prefixes, checkpoints or not, ids or bytes), matches
with leases held or released, allocation pressure and idle demotion on a store with a host
tier. Every time the store asks its index for the next victim of a tier, the answer is checked
against the definition computed the old way — a scan of every node, residency probed page by
page, no counters — and after every step ``check_integrity`` compares the per-node counts and
the queues with a full scan.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tierstore.config import StoreConfig
from tierstore.radix import PAGE_KINDS, Node, RadixIndex
from tierstore.results import Lease
from tierstore.store import TierStore

from .conftest import HYBRID, PAGE, layout


def holds_scan(n: Node, tier: int) -> bool:
    return n.checkpoint(tier) >= 0 or any(v >= 0 for k in PAGE_KINDS for v in n.ids(tier, k))


def oracle(index: RadixIndex, tier: int) -> Node | None:
    """The first victim as the old ``victims()`` defined it: unlocked non-root nodes holding
    something in ``tier`` while no child does, smallest policy key first."""
    found = [n for n in index.nodes() if n.lock == 0 and holds_scan(n, tier)
             and not any(holds_scan(c, tier) for c in n.children.values())]
    return min(found, key=lambda n: (index.key(n), n.serial)) if found else None


FAMILIES = 3  # prompts share one of a few system prompts, then diverge


class StoreMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lfu", "priority"]),
                rule_=st.sampled_from(["unified", "per_kind"]))
    def build(self, policy: str, rule_: str) -> None:
        lay = layout(HYBRID)
        units = lay.envelopes()
        one = 4 * (units["kv"].nbytes + units["swa"].nbytes) + units["state"].nbytes
        self.store = TierStore(lay, StoreConfig(capacity_bytes=(6 * one // 256 + 1) * 256,
                                                host_capacity_bytes=(3 * one // 256 + 1) * 256,
                                                eviction=policy, stop_rule=rule_))
        self.leases: list[Lease] = []
        self.checked = 0
        index = self.store.index
        asked = index.next_victim

        def checked_next_victim(tier: int) -> Node | None:
            got = asked(tier)
            want = oracle(index, tier)
            assert got is want, f"tier {tier}: queue chose {got!r}, a full scan {want!r}"
            self.checked += 1
            return got

        index.next_victim = checked_next_victim  # type: ignore[method-assign]

    def prompt(self, family: int, branch: int, pages: int) -> list[int]:
        head = [1000 * family + i for i in range(2 * PAGE)]
        tail = [100_000 + 977 * branch + i for i in range((pages - 2) * PAGE)]
        return head + tail

    @rule(family=st.integers(0, FAMILIES - 1), branch=st.integers(0, 5),
          pages=st.integers(2, 5), checkpoint=st.booleans(), as_bytes=st.booleans(),
          priority=st.integers(0, 2))
    def insert(self, family: int, branch: int, pages: int, checkpoint: bool, as_bytes: bool,
               priority: int) -> None:
        s = self.store
        tokens = self.prompt(family, branch, pages)
        if as_bytes:
            units = {k: s.arena.spec(k).unit_bytes for k in s.kinds}
            fill = (family * 7 + branch) % 251
            s.insert(tokens, kv=torch.full((pages, units["kv"]), fill, dtype=torch.uint8),
                     swa=torch.full((2, units["swa"]), fill, dtype=torch.uint8),
                     state=torch.full((units["state"],), fill, dtype=torch.uint8)
                     if checkpoint else None, priority=priority)
            return
        m = s.match(tokens)  # an engine sends only the pages the match did not cover
        new = pages - m.pages
        demand = {"kv": new, "swa": min(new, 2), **({"state": 1} if checkpoint else {})}
        got = s.allocate(demand)
        if got is not None:
            s.insert(tokens, kv=got["kv"], swa=got["swa"],
                     state=got["state"] if checkpoint else None, priority=priority)
        if m.lease is not None:
            s.release(m.lease)

    @rule(family=st.integers(0, FAMILIES - 1), branch=st.integers(0, 5),
          pages=st.integers(1, 5), hold=st.booleans())
    def match(self, family: int, branch: int, pages: int, hold: bool) -> None:
        m = self.store.match(self.prompt(family, branch, max(pages, 2))[: pages * PAGE + 1])
        if m.lease is not None:
            if hold and len(self.leases) < 3:
                self.leases.append(m.lease)
            else:
                self.store.release(m.lease)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 2))
    def release(self, i: int) -> None:
        self.store.release(self.leases.pop(i % len(self.leases)))

    @rule(kv=st.integers(0, 12), state=st.integers(0, 2))
    def pressure(self, kv: int, state: int) -> None:
        got = self.store.allocate({"kv": kv, "state": state})
        if got is not None:
            for kind, ids in got.blocks.items():
                self.store.free(kind, ids)

    @rule()
    def demote_idle(self) -> None:
        self.store.demote_idle(0.0)

    @invariant()
    def consistent(self) -> None:
        self.store.check_integrity()
        for tier in (1, 2, 3):
            assert self.store.index.next_victim(tier) is oracle(self.store.index, tier)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
