"""The remap reference (and the CPU dispatcher) against a plain Python loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import KernelArgumentError


def naive_remap(table: list[int], ids: list[int], sink: int, page_size: int) -> list[int]:
    out: list[int] = []
    for i in ids:
        slot = table[i] if 0 <= i < len(table) else -1
        if slot < 0:
            out += [sink] * page_size
        else:
            out += [slot * page_size + t for t in range(page_size)] if page_size > 1 else [slot]
    return out


@settings(max_examples=200, deadline=None)
@given(
    table=st.lists(st.integers(-2, 50), max_size=20),
    ids=st.lists(st.integers(-30, 30), max_size=30),
    sink=st.integers(0, 10_000),
    page_size=st.sampled_from([1, 2, 16]),
    table_dtype=st.sampled_from([torch.int32, torch.int64]),
    ids_dtype=st.sampled_from([torch.int16, torch.int32, torch.int64]),
)
def test_reference_matches_naive_loop(
    table: list[int], ids: list[int], sink: int, page_size: int, table_dtype: torch.dtype,
    ids_dtype: torch.dtype,
) -> None:
    t, i = torch.tensor(table, dtype=table_dtype), torch.tensor(ids, dtype=ids_dtype)
    expected = naive_remap(table, ids, sink, page_size)
    for fn in (kernels.remap_reference, kernels.remap):
        got = fn(t, i, sink=sink, page_size=page_size)
        assert got.tolist() == expected
        assert got.dtype == (table_dtype if page_size == 1 else torch.int64)


def test_out_and_out_dtype() -> None:
    table = torch.tensor([3, -1, 0], dtype=torch.int64)
    out = torch.full((6,), 123, dtype=torch.int32)
    got = kernels.remap(table, torch.tensor([0, 1, 2]), sink=9, page_size=2, out=out,
                        out_dtype=torch.int32)
    assert got is out
    assert out.tolist() == [6, 7, 9, 9, 0, 1]


def test_never_reads_outside_the_table() -> None:
    table = torch.tensor([5], dtype=torch.int32)
    ids = torch.tensor([-(2**62), -1, 0, 1, 2**62])
    assert kernels.remap(table, ids, sink=0).tolist() == [0, 0, 5, 0, 0]
    empty = torch.empty(0, dtype=torch.int64)
    assert kernels.remap(empty, ids, sink=4).tolist() == [4] * 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(page_size=0), "page_size must be >= 1, got 0"),
        (dict(sink=2**31), "sink 2147483648 does not fit torch.int32"),
        (dict(table=torch.zeros(3, dtype=torch.float32)), "table must be 1-D int32 or int64"),
        (dict(ids=torch.zeros(2, 2, dtype=torch.int64)), "ids must be 1-D signed integers"),
        (dict(out_dtype=torch.int16), "out_dtype must be int32 or int64"),
        (dict(out=torch.zeros(3, dtype=torch.int32)), "out must be a contiguous 1-D torch.int32"),
    ],
)
def test_misuse_raises_with_numbers(kwargs: dict, match: str) -> None:
    args: dict = dict(table=torch.zeros(3, dtype=torch.int32), ids=torch.tensor([0, 1]), sink=0)
    args.update(kwargs)
    with pytest.raises(KernelArgumentError, match=match):
        kernels.remap(args.pop("table"), args.pop("ids"), **args)
