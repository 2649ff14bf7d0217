"""The results' fast constructors (tierstore.results) against the dataclasses' own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from tierstore.results import (
    Allocation,
    InsertResult,
    MatchResult,
    allocation,
    insert_result,
    match_result,
)


@pytest.mark.parametrize(("make", "cls"), [(match_result, MatchResult),
                                           (insert_result, InsertResult),
                                           (allocation, Allocation)])
def test_fast_constructors_take_every_field_in_order(make: object, cls: type) -> None:
    """A field added to the dataclass without its constructor fails here."""
    params = list(inspect.signature(make).parameters)  # type: ignore[arg-type]
    assert params == [f.name for f in dataclasses.fields(cls)]


def test_match_result_equals_the_dataclass_and_stays_frozen() -> None:
    kv, swa = torch.tensor([3, 4]), torch.tensor([5, -1])
    fast = match_result(32, 2, kv, swa, 7, None, 3, {"l1": 32}, {"cold": 16}, {})
    slow = MatchResult(32, 2, kv, swa, 7, None, 3, {"l1": 32}, {"cold": 16}, {})
    assert type(fast) is MatchResult
    assert vars(fast) == vars(slow)
    assert fast == slow and repr(fast) == repr(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.pages = 1  # type: ignore[misc]


def test_insert_result_equals_the_dataclass() -> None:
    args = (True, 3, 2, False, 1, 0)
    fast = insert_result(*args)
    assert type(fast) is InsertResult
    assert fast == InsertResult(*args) and hash(fast) == hash(InsertResult(*args))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.stored = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        insert_result(*args[:-1])  # type: ignore[call-arg]


def test_allocation_equals_the_dataclass_and_stays_frozen() -> None:
    blocks = {"kv": torch.tensor([1, 2]), "swa": torch.tensor([3])}
    fast = allocation(blocks)
    assert type(fast) is Allocation
    assert vars(fast) == vars(Allocation(blocks)) and repr(fast) == repr(Allocation(blocks))
    assert fast["kv"] is blocks["kv"] and fast["state"].numel() == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.blocks = {}  # type: ignore[misc]
