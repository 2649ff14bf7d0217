"""End to end: the reference hybrid model's logits with a prefix hit equal those computed from
scratch — through eviction pressure and compaction, and from the host and Redis tiers. The
tests that take ``device`` also run with the whole store (arena, kernels, pinned host tier) on
CUDA when there is a GPU."""

from __future__ import annotations

import pytest
import torch

from tierstore.config import StoreConfig
from tierstore.store import TierStore
from tierstore.testing.reference_model import ReferenceModel, tiny_layout

LAYOUT = tiny_layout(page_size=4)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}
ONE_REQUEST = 8 * (UNITS["kv"] + UNITS["swa"]) + 3 * UNITS["state"]  # a 30-token request's blocks
CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.fixture(params=["cpu", CUDA])
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def model(capacity: int = 1 << 20, **kwargs: object) -> ReferenceModel:
    store = TierStore(LAYOUT, StoreConfig(capacity_bytes=capacity, **kwargs))  # type: ignore[arg-type]
    return ReferenceModel(store, seed=7)


def same_logits(served: torch.Tensor, p: list[int], new: int = 4) -> bool:
    """``served`` equals the logits computed from scratch on the same device. A GPU may pick
    other reduction orders for other shapes, hence the looser bound there."""
    cold = model(device=str(served.device)).generate(p, new, use_cache=False).logits
    return torch.allclose(served, cold, atol=1e-6 if served.device.type == "cpu" else 1e-5,
                          rtol=0)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 97, (n,), generator=g)]


def test_prefix_hit_gives_the_same_logits(device: str) -> None:
    p = prompt(27, 1)
    m = model(device=device)
    first = m.generate(p, 4)
    assert first.cached_tokens == 0
    second = m.generate(p, 4)
    assert second.cached_tokens == 24  # the checkpoint at the last full page of the prompt
    assert same_logits(second.logits, p)
    assert second.tokens == first.tokens
    m.store.check_integrity()


def test_shared_prefix_of_another_request_is_reused() -> None:
    base = prompt(16, 2)
    m = model()
    m.generate([*base, 1, 2, 3], 0)  # caches 16 tokens... and a checkpoint at 16
    other = base + prompt(11, 3)
    served = m.generate(other, 3)
    assert served.cached_tokens == 16
    assert same_logits(served.logits, other, 3)


def test_hit_after_eviction_pressure_and_compaction(device: str) -> None:
    capacity = 4 * ONE_REQUEST  # about four requests' worth: later requests force evictions
    m = model(capacity, device=device)
    target = prompt(30, 10)
    m.generate(target, 2)
    for i in range(12):
        m.generate(prompt(30, 100 + i), 2)
        if i % 3 == 2:  # keep the target recent so LRU keeps it
            m.generate(target, 0)
    stats = m.store.stats()
    assert stats.evictions > 0
    m.store.arena.compact()
    assert m.store.arena.stats().moves > 0
    m.store.check_integrity()
    served = m.generate(target, 4)
    assert served.cached_tokens == 28
    assert same_logits(served.logits, target)


def test_evicted_prefix_is_recomputed_correctly() -> None:
    m = model(3 * ONE_REQUEST)
    target = prompt(30, 20)
    m.generate(target, 2)
    for i in range(6):
        m.generate(prompt(30, 200 + i), 2)
    assert m.store.peek(target[:-1]) == 0  # pushed out
    served = m.generate(target, 4)
    assert served.cached_tokens == 0
    assert same_logits(served.logits, target)
    m.store.check_integrity()


def test_namespaces_do_not_share_prefixes() -> None:
    p = prompt(20, 4)
    m = model()
    m.generate(p, 0, namespace="tenant-a")
    assert m.generate(p, 0, namespace="tenant-b").cached_tokens == 0
    assert m.generate(p, 0, namespace="tenant-a").cached_tokens == 16


def _pushed_out(m: ReferenceModel, target: list[int], others: int, seed: int) -> None:
    for i in range(others):
        m.generate(prompt(30, seed + i), 2)
    assert m.store.peek(target[:-1]) == 0, "the target should have left L1"


def _served_back_from(m: ReferenceModel, tier: int, seed: int) -> None:
    """A prefix pushed out of L1 into ``tier`` comes back: same logits as from scratch."""
    target = prompt(30, seed)
    m.generate(target, 2)
    _pushed_out(m, target, 4, 10 * seed)
    assert m.store.peek(target[:-1], tiers=(tier,)) == 28
    served = m.generate(target, 4)
    assert served.cached_tokens == 28
    assert m.store.stats().hit_requests[f"l{tier}"] >= 1
    assert same_logits(served.logits, target)
    m.store.check_integrity()


def test_prefix_back_from_host_tier_gives_the_same_logits(device: str) -> None:
    m = model(2 * ONE_REQUEST, host_capacity_bytes=20 * ONE_REQUEST, device=device)
    _served_back_from(m, 2, seed=30)


def test_prefix_back_from_redis_gives_the_same_logits(redis_url: str, device: str) -> None:
    from remote_tier import RemoteTierConfig

    m = model(2 * ONE_REQUEST, remote=RemoteTierConfig(url=redis_url, key_prefix="ref"),
              device=device)
    _served_back_from(m, 3, seed=40)
    m.store.close()
