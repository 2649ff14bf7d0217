"""``bench ops --accounting-off``: the same loop on two more stores, accounting on and off.

The store's accounting (miss attribution with its ghost index, and the miss-ratio shadow) is
switched by ``StoreConfig.attribution`` / ``StoreConfig.mrc``. Both stores of the pair run the
engine loop bare (no timing hooks around single calls, which would cost a clock read each and
inflate both sides), interleaved with the other systems on the same prompts; the rise is the
pair's µs per request, on over off, minus 1. Both must hit the same tokens: accounting
observes the cache, it never changes it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tierstore.store import TierStore

ON, OFF = "accounting-on", "accounting-off"


class BareLoop:
    """``bench ops``'s engine loop (match, allocate what missed, insert, release) with no
    timing inside it."""

    def __init__(self, name: str, store: TierStore) -> None:
        self.name = name
        self.store = store
        self.page = store.layout.page_size
        self.extra = {**({"swa": 0} if "swa" in store.kinds else {}),
                      **({"state": 1} if "state" in store.kinds else {})}
        self.failed = 0

    def step(self, prompt: np.ndarray) -> None:
        store = self.store
        m = store.match(prompt)
        pages = len(prompt) // self.page - m.pages
        demand = {"kv": pages, **self.extra}
        if "swa" in demand:
            demand["swa"] = pages
        got = store.allocate(demand)
        if got is None:
            self.failed += 1
        else:
            store.insert(prompt, kv=got["kv"], swa=got.blocks.get("swa"),
                         state=got.blocks.get("state"))
        if m.lease is not None:
            store.release(m.lease)

    def evictions(self) -> int:
        return self.store.ledger.evictions


def accounting_pair(make_store: Callable[[bool], TierStore]) -> list[BareLoop]:
    """Two bare loops over fresh stores from ``make_store(accounting)``: on, then off."""
    return [BareLoop(ON, make_store(True)), BareLoop(OFF, make_store(False))]


def rise(pair: list[BareLoop], us: Callable[[str], float | None]) -> dict[str, object]:
    """The pair's figures: µs per request on and off (``us(name)``), the rise, and whether
    both stores hit the same tokens."""
    on, off = us(ON), us(OFF)
    hits = [loop.store.ledger.tokens_hit for loop in pair]
    return {"on_us": on, "off_us": off,
            "rise": on / off - 1 if on is not None and off else None,
            "same_hits": hits[0] == hits[1], "failed": sum(loop.failed for loop in pair)}
