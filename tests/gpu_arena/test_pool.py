"""The pool's change log and :meth:`Pool.patch`, which keep a device mirror of the location
table current by copying only changed entries (run here with a CPU tensor as the mirror)."""

from __future__ import annotations

import random

import torch

from gpu_arena.pool import Pool
from gpu_arena.spec import PoolSpec

SLOTS = 64


def _pool() -> Pool:
    pool = Pool(PoolSpec("kv", 16, "low"), origin=0, max_slots=SLOTS, lo=0)
    pool.start_log()
    return pool


def _random_step(pool: Pool, rng: random.Random) -> None:
    """One take, release or move of up to three blocks (array or list paths)."""
    live = torch.nonzero(pool.owner >= 0).flatten().tolist()
    free = torch.nonzero(pool.owner < 0).flatten().tolist()
    op = rng.choice(["take", "release", "move", "bind", "unbind"])
    n = rng.randint(1, 3)
    if op == "take" and len(free) >= n:
        pool.take_ids(torch.tensor(rng.sample(free, n)))
    elif op == "release" and len(live) >= n:
        pool.release_ids(pool.owner[torch.tensor(rng.sample(live, n))])
    elif op == "bind" and len(free) >= n:  # the list paths (alloc_ids, free_owned)
        pool.bind(rng.sample(free, n))
    elif op == "unbind" and len(live) >= n:
        pool.free_few([int(pool.owner[s]) for s in rng.sample(live, n)])
    elif op == "move" and live and free:
        n = min(n, len(live), len(free))
        pool.relink(torch.tensor(rng.sample(live, n)), torch.tensor(rng.sample(free, n)))


def test_patch_brings_the_mirror_up_to_date() -> None:
    pool = _pool()
    mirror = pool.loc.clone()
    rng = random.Random(7)
    for round_ in range(200):
        for _ in range(rng.randint(1, 3)):
            _random_step(pool, rng)
        assert pool.num_changed < SLOTS, "a few changes must stay in the log"
        pool.patch(mirror)
        assert torch.equal(mirror, pool.loc), f"round {round_}: mirror differs after patch"
        assert pool.num_changed == 0 and pool.changed == []


def test_patch_scatters_only_logged_entries() -> None:
    pool = _pool()
    mirror = pool.loc.clone()
    mirror[-1] = 999  # an id nothing touches: a scatter leaves it, a full copy would not
    pool.take_ids(torch.tensor([5, 9]))  # ids 0 and 1
    pool.patch(mirror)
    assert torch.equal(mirror[:-1], pool.loc[:-1]) and int(mirror[-1]) == 999


def test_many_changes_collapse_to_a_full_copy() -> None:
    pool = _pool()
    mirror = pool.loc.clone()
    pool.take_ids(torch.arange(SLOTS // 2))
    assert pool.num_changed == SLOTS and pool.changed == [], "past a quarter: full copy"
    mirror[-1] = 999  # not in any log, yet a full copy repairs it
    pool.patch(mirror)
    assert torch.equal(mirror, pool.loc)


def test_no_log_without_a_mirror() -> None:
    pool = Pool(PoolSpec("kv", 16, "low"), origin=0, max_slots=SLOTS, lo=0)
    pool.take_ids(torch.arange(4))
    assert pool.changed is None and pool.num_changed == 0


def test_the_log_keeps_its_own_copy_of_the_ids() -> None:
    pool = _pool()
    mirror = pool.loc.clone()
    ids = pool.take_ids(torch.tensor([3, 4]))
    ids[0] = 40  # the caller reuses its tensor
    pool.patch(mirror)
    assert torch.equal(mirror, pool.loc)


def test_the_log_copies_list_ids() -> None:
    pool = _pool()
    mirror = pool.loc.clone()
    ids = pool.bind([3, 4])
    ids[0] = 40  # the caller owns its list
    pool.patch(mirror)
    assert torch.equal(mirror, pool.loc)
