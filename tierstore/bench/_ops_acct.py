"""``bench ops --accounting-off``: the same loop on two more stores, accounting on and off.

The store's accounting (miss attribution with its ghost index, and the miss-ratio shadow) is
switched by ``StoreConfig.attribution`` / ``StoreConfig.mrc``. Both stores of the pair run the
engine loop bare (no timing hooks around single calls, which would cost a clock read each and
inflate both sides), interleaved with the other systems on the same prompts; the rise is the
pair's µs per request, on over off, minus 1. Both must hit the same tokens: accounting
observes the cache, it never changes it.

Run back to back (``--pair-order fixed``, rounds 5-7), the second of the pair follows the same
code and finds the CPU's caches warm, so the first (on) is charged for the cold start. By
default (``alternate``) the two are split around another system, and swap slots every turn.
Beside the total ratio (``rise``, comparable across rounds), :func:`rise` gives the per-turn
ratios' median, quartiles and extremes, and the total ratio over the turns where each side went
first.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np

from tierstore.store import TierStore

ON, OFF = "accounting-on", "accounting-off"
ORDERS = ("alternate", "fixed")
T = TypeVar("T")


class Clock(Protocol):
    """What :func:`rise` reads of ``bench ops``' clock: µs per request per system, and the CPU
    seconds each system spent on each turn (the pair's lists are aligned: both run every turn)."""

    turns: dict[str, list[float]]

    def us(self, name: str) -> float | None: ...


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


def turn_order(systems: list[T], pair: Sequence[T], turn: int, order: str,
               after: T | None = None) -> list[T]:
    """``systems`` in this turn's order. "fixed" keeps them as given (rounds 5-7: on, then off,
    back to back). "alternate" splits the pair: the one going first this turn (on on even
    turns, off on odd ones) runs right after ``after`` (first of all when None), the other
    last, so neither follows the other and finds the CPU's caches warmed by the same code."""
    if order not in ORDERS:
        raise ValueError(f"pair order {order!r}; known: {', '.join(ORDERS)}")
    if not pair or order == "fixed":
        return systems
    first, second = (pair[0], pair[1]) if turn % 2 == 0 else (pair[1], pair[0])
    rest = [s for s in systems if s != first and s != second]
    i = rest.index(after) + 1 if after is not None else 0
    return [*rest[:i], first, *rest[i:], second]


def rise(pairs: Sequence[Sequence[BareLoop]], clock: Clock, order: str) -> dict[str, object]:
    """The pair's figures over every pair in ``pairs`` (one per fill run): µs per request on and
    off, the rise (total on / total off - 1), the per-turn rises' median, quartiles and extremes,
    the total rise over the turns where on, and where off, went first, and whether each pair's
    stores hit the same tokens."""
    on, off = clock.us(ON), clock.us(OFF)
    on_turns, off_turns = clock.turns[ON], clock.turns[OFF]
    assert len(on_turns) == len(off_turns), "the pair runs every turn, both of its stores"
    per_turn = sorted(a / b - 1 for a, b in zip(on_turns, off_turns, strict=True) if b > 0)
    # Turn i's first: on on even turns either way, off on odd turns when alternating.
    firsts = [ON if order == "fixed" or i % 2 == 0 else OFF for i in range(len(on_turns))]

    def total(first: str) -> float | None:
        a = sum(s for s, f in zip(on_turns, firsts, strict=True) if f == first)
        b = sum(s for s, f in zip(off_turns, firsts, strict=True) if f == first)
        return a / b - 1 if b > 0 else None

    q1 = q3 = None
    if len(per_turn) >= 2:
        q1, _, q3 = statistics.quantiles(per_turn, n=4, method="inclusive")
    elif per_turn:
        q1 = q3 = per_turn[0]
    return {"on_us": on, "off_us": off,
            "rise": on / off - 1 if on is not None and off else None,
            "rise_median": statistics.median(per_turn) if per_turn else None,
            "rise_q1": q1, "rise_q3": q3,
            "rise_iqr": q3 - q1 if q1 is not None and q3 is not None else None,
            "rise_min": per_turn[0] if per_turn else None,
            "rise_max": per_turn[-1] if per_turn else None,
            "rise_on_first": total(ON), "rise_off_first": total(OFF),
            "turns": len(per_turn), "order": order,
            "same_hits": all(p[0].store.ledger.tokens_hit == p[1].store.ledger.tokens_hit
                             for p in pairs),
            "failed": sum(loop.failed for p in pairs for loop in p)}
