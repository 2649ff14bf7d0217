"""The CPU path of the dispatcher (``memmove`` or numpy per item) and its overlap check."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import host_copy
from kernels.host_copy import copy_host
from kernels.layout import has_hazard, make_layout


@pytest.mark.parametrize("mover", ["memmove", "numpy"])
@pytest.mark.parametrize("same_buffer", [False, True])
def test_dispatcher_matches_reference_on_cpu(
    copy_case, monkeypatch, mover: str, same_buffer: bool
) -> None:
    """Both movers, in tasks of a few items spread over three threads."""
    monkeypatch.setattr(host_copy, "MEMMOVE_ITEM_BYTES", 1 if mover == "memmove" else 1 << 40)
    monkeypatch.setattr(host_copy, "TASK_BYTES", 100)
    monkeypatch.setattr(host_copy, "_CPUS", 3)  # as on 3 CPUs, whatever this process may use
    submitted = []
    pool = host_copy._pool()
    real_submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda *a: submitted.append(a) or real_submit(*a))
    rng = random.Random(5 + same_buffer)
    for _ in range(60):
        case = copy_case(rng, same_buffer=same_buffer, max_nbytes=64,
                         align=rng.choice([1, 8]))
        assert torch.equal(case.run(kernels.strided_copy), case.expected()), case.kwargs
    assert submitted


def test_default_thresholds_match_reference(copy_case) -> None:
    rng = random.Random(8)
    for _ in range(12):
        case = copy_case(rng, same_buffer=rng.random() < 0.5, align=rng.choice([1, 16]),
                         max_nbytes=2 * host_copy.MEMMOVE_ITEM_BYTES, max_pairs=4)
        assert torch.equal(case.run(kernels.strided_copy), case.expected()), case.kwargs


def _layout(nbytes: int, stride: int, dst_offset: int = 0):  # type: ignore[no-untyped-def]
    return make_layout(nbytes, stride, stride, 0, dst_offset, 1, 0, 0)


@pytest.mark.parametrize("overlap", [None, True, False])
def test_copy_host_stages_only_when_needed(monkeypatch, overlap: bool | None) -> None:
    big = host_copy.MEMMOVE_ITEM_BYTES
    calls: list[int] = []
    real = host_copy.memmove_all

    def counted(writes: list[int], reads: list[int], nbytes: int) -> None:
        calls.append(len(writes))
        real(writes, reads, nbytes)

    monkeypatch.setattr(host_copy, "memmove_all", counted)
    buf = torch.arange(8 * big, dtype=torch.int64).to(torch.uint8)
    chain = (torch.tensor([0, 1]), torch.tensor([1, 2]))  # 1 -> 2 reads what 0 -> 1 writes
    disjoint = (torch.tensor([4, 5]), torch.tensor([1, 2]))
    for (s, d), hazard in ((chain, True), (disjoint, False)):
        if overlap is False and hazard:
            continue  # the caller's word is taken: a chain would be copied wrongly
        calls.clear()
        expected = buf.clone()
        kernels.strided_copy_reference(expected, expected, s, d, nbytes=big, src_stride=big,
                                       dst_stride=big)
        got = buf.clone()
        copy_host(got, got, s, d, _layout(big, big), overlap=overlap)
        assert torch.equal(got, expected)
        staged = overlap is True or (overlap is None and hazard)
        assert calls == ([2, 2] if staged else [2])


def test_in_place_items_are_not_hazards() -> None:
    reads = np.array([0, 100, 200])
    assert not has_hazard(reads, reads.copy(), 100)
    assert has_hazard(reads, np.array([0, 100, 299]), 100)
    assert not has_hazard(reads, np.array([300, 100, 200]), 100)


@settings(max_examples=300, deadline=None)
@given(
    reads=st.lists(st.integers(0, 200), min_size=1, max_size=12),
    writes=st.lists(st.integers(0, 200), min_size=1, max_size=12),
    nbytes=st.integers(1, 40),
)
def test_has_hazard_matches_brute_force(reads: list[int], writes: list[int], nbytes: int) -> None:
    n = min(len(reads), len(writes))
    reads, writes = reads[:n], writes[:n]
    moving = [(r, w) for r, w in zip(reads, writes, strict=True) if r != w]
    expected = any(abs(r - w) < nbytes for r, _ in moving for _, w in moving)
    assert has_hazard(np.array(reads), np.array(writes), nbytes) == expected
