"""Random alloc / free / write / compact / fence sequences over three pools of different unit
sizes; after every step every live block reads back the bytes last written to it, and every
resolve agrees with the location table. The same machine runs on CUDA when there is a GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpu_arena import Arena, PoolSpec

POOLS = [PoolSpec("state", 96, "low"), PoolSpec("swa", 64, "float"), PoolSpec("kv", 48, "high")]
CAPACITY = 2048 + 16  # not a multiple of any unit: the high band's origin is offset


class ArenaMachine(RuleBasedStateMachine):
    DEVICE = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.arena = Arena(CAPACITY, POOLS, device=self.DEVICE)
        for pool, small in zip(self.arena._pools.values(), (0, 2, 64), strict=True):
            pool.sweep_slack = 0  # sweep the hole heap often (real pools wait for 16 stale)
            # Bind and release through numpy (state), both paths by size (swa) and the
            # memoryview loops (kv): they must agree.
            pool.small_batch = small
        self.units = {p.name: p.unit_bytes for p in POOLS}
        self.data: dict[tuple[str, int], torch.Tensor] = {}  # (pool, id) -> expected bytes
        # Each pending fence: its pool, block id, slot at fencing time, and whether the block
        # is still the one fenced (ids are reused after a free).
        self.fences: list[dict] = []
        self.counter = 0

    def _fresh(self, pool: str, n: int) -> torch.Tensor:
        self.counter += 1
        g = torch.Generator().manual_seed(self.counter)
        return torch.randint(0, 256, (n, self.units[pool]), dtype=torch.uint8, generator=g)

    def _live(self, pool: str) -> list[int]:
        return sorted(i for (p, i) in self.data if p == pool)

    def _pinned_slots(self, pool: str) -> set[int]:
        return {f["slot"] for f in self.fences if f["pool"] == pool}

    @rule(pool=st.sampled_from([p.name for p in POOLS]), n=st.integers(0, 6),
          listed=st.booleans())
    def alloc(self, pool: str, n: int, listed: bool) -> None:
        """Through :meth:`Arena.alloc`, or :meth:`Arena.alloc_ids` as the store does."""
        predicted = self.arena.can_alloc({pool: n})
        if listed:
            got = self.arena.alloc_ids(pool, n)
            ids = None if got is None else torch.tensor(got, dtype=torch.long)
        else:
            ids = self.arena.alloc(pool, n)
        assert (ids is not None) == predicted, f"can_alloc said {predicted} for {pool}:{n}"
        if ids is None:
            return
        slots = self.arena.resolve(pool, ids).tolist()
        # A slot held by a pending fence is never handed out, whether its block was freed or
        # moved away by compaction while the fence was in flight.
        assert not set(slots) & self._pinned_slots(pool), f"pending slot reused in {pool}"
        data = self._fresh(pool, n)
        self.arena.write(pool, ids, data)
        for i, vid in enumerate(ids.tolist()):
            self.data[(pool, vid)] = data[i]

    @rule(pools=st.fixed_dictionaries({p.name: st.integers(0, 4) for p in POOLS}))
    def joint(self, pools: dict[str, int]) -> None:
        """can_alloc for a joint request promises every part succeeds, in any order."""
        if not self.arena.can_alloc(pools):
            return
        for pool in reversed(list(pools)):
            ids = self.arena.alloc(pool, pools[pool])
            assert ids is not None, f"joint {pools} promised but {pool} failed"
            data = self._fresh(pool, len(ids))
            self.arena.write(pool, ids, data)
            for i, vid in enumerate(ids.tolist()):
                self.data[(pool, vid)] = data[i]

    @precondition(lambda self: bool(self.data))
    @rule(pick=st.data(), owned=st.sampled_from(["no", "list", "array"]))
    def free(self, pick: st.DataObject, owned: str) -> None:
        """Free through :meth:`Arena.free`, or :meth:`Arena.free_owned` as the store's eviction
        does (live ids, each once: no re-validation), given a list or an array."""
        keys = sorted(self.data)
        chosen = pick.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=5, unique=True))
        pool = chosen[0][0]
        ids = [vid for p, vid in chosen if p == pool]
        if owned == "list":
            self.arena.free_owned(pool, ids)
        elif owned == "array":
            self.arena.free_owned(pool, np.asarray(ids))
        else:
            self.arena.free(pool, ids)
        for vid in ids:
            del self.data[(pool, vid)]
        for f in self.fences:
            if f["pool"] == pool and f["vid"] in ids:
                f["alive"] = False

    @precondition(lambda self: bool(self.data))
    @rule(pick=st.data())
    def overwrite(self, pick: st.DataObject) -> None:
        pool, vid = pick.draw(st.sampled_from(sorted(self.data)))
        data = self._fresh(pool, 1)
        self.arena.write(pool, [vid], data)
        self.data[(pool, vid)] = data[0]

    @rule(max_moves=st.one_of(st.none(), st.integers(0, 5)))
    def compact(self, max_moves: int | None) -> None:
        live = {p: self.arena.num_live(p) for p in self.units}
        moved = self.arena.compact(max_moves)
        assert max_moves is None or moved <= max_moves
        assert live == {p: self.arena.num_live(p) for p in self.units}  # moves, never frees
        if max_moves is None:
            assert self.arena.compact() == 0, "a full compaction left movable work behind"

    @precondition(lambda self: bool(self.data) and len(self.fences) < 4)
    @rule(pick=st.data(), mode=st.sampled_from(["read", "write"]))
    def fence(self, pick: st.DataObject, mode: str) -> None:
        pool, vid = pick.draw(st.sampled_from(sorted(self.data)))
        fence = self.arena.fence(pool, [vid], mode)  # type: ignore[arg-type]
        slot = int(self.arena.resolve(pool, [vid])[0])
        self.fences.append(
            {"fence": fence, "pool": pool, "vid": vid, "slot": slot, "mode": mode, "alive": True}
        )

    @precondition(lambda self: bool(self.fences))
    @rule(pick=st.data())
    def retire(self, pick: st.DataObject) -> None:
        i = pick.draw(st.integers(0, len(self.fences) - 1))
        self.fences.pop(i)["fence"].complete()

    @invariant()
    def bytes_survive(self) -> None:
        self.arena.check_integrity()
        for pool in self.units:
            ids = self._live(pool)
            assert self.arena.num_live(pool) == len(ids)
            if not ids:
                continue
            got = self.arena.read(pool, ids).cpu()
            want = torch.stack([self.data[(pool, i)] for i in ids])
            assert torch.equal(got, want), f"{pool}: bytes changed"

    @invariant()
    def resolve_matches_reads(self) -> None:
        """``resolve`` (the device mirror of the location table on CUDA, patched with only what
        changed) names the slots whose bytes ``read`` returns."""
        for pool in self.units:
            ids = self._live(pool)
            if not ids:
                continue
            slots = self.arena.resolve(pool, ids).cpu()
            rows = self.arena.buffer.cpu()[self._slot_bytes(pool, slots)]
            want = torch.stack([self.data[(pool, i)] for i in ids])
            assert torch.equal(rows, want), f"{pool}: resolve points at the wrong slots"

    def _slot_bytes(self, pool: str, slots: torch.Tensor) -> torch.Tensor:
        """Byte offsets ``[n, unit]`` of ``slots`` in the arena buffer."""
        spec = self.arena.spec(pool)
        origin = CAPACITY % spec.unit_bytes if spec.anchor == "high" else 0
        unit = spec.unit_bytes
        return origin + slots.unsqueeze(1) * unit + torch.arange(unit)

    @invariant()
    def write_fenced_blocks_stay(self) -> None:
        for f in self.fences:
            if f["mode"] == "write" and f["alive"]:
                assert int(self.arena.resolve(f["pool"], [f["vid"]])[0]) == f["slot"]


ArenaMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("ARENA_EXAMPLES", "60")), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestArenaMachine = ArenaMachine.TestCase


class CudaArenaMachine(ArenaMachine):
    DEVICE = "cuda"


CudaArenaMachine.TestCase.settings = ArenaMachine.TestCase.settings
TestCudaArenaMachine = pytest.mark.gpu(pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")(CudaArenaMachine.TestCase))
