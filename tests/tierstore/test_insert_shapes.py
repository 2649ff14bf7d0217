"""Insert's shape checks: ids straight from ``allocate`` (1-D long tensors) are tested inline,
anything else through ``checks.blocks`` and ``checks.counts``. Both must refuse the same
inputs with the same error and change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierstore.errors import ShapeError
from tierstore.store import TierStore

from .conftest import FULL_ONLY, HYBRID, PAGE, SWA_ONLY, store
from .test_store import put, toks


def _snapshot(s: TierStore) -> tuple[object, ...]:
    nodes = [(n.depth, tuple(n.keys), n.lock, n.last_use, n.hits, tuple(n.queued),
              tuple(n._held), tuple(n._child_held), tuple(n._state),
              [{k: tuple(v) for k, v in c.items()} for c in n._pages])
             for n in s.index.nodes()]
    return (nodes, {k: set(v) for k, v in s.ledger.handed.items()}, s.stats())


def _error(s: TierStore, prompt: np.ndarray, **given: object) -> str:
    before = _snapshot(s)
    with pytest.raises(ShapeError) as info:
        s.insert(prompt, **given)  # type: ignore[arg-type]
    assert _snapshot(s) == before
    s.check_integrity()
    return str(info.value)


def _cases(s: TierStore) -> list[tuple[np.ndarray, dict[str, list[int]]]]:
    """Bad shapes for a store holding the first 2 pages of ``toks(40)`` (ids the caller
    holds, so only the shape is wrong)."""
    got = s.allocate({k: 12 if k != "state" else 2 for k in s.kinds})
    assert got is not None
    kv, swa = got["kv"].tolist(), got.blocks["swa"].tolist() if "swa" in s.kinds else None
    state = got.blocks["state"].tolist() if "state" in s.kinds else None
    ten = np.arange(40, dtype=np.int64)  # 10 pages, 2 cached
    cases = [(ten, {"kv": kv[:11]}), (ten, {"kv": kv[:7]}), (ten[:39], {"kv": kv[:10]})]
    if swa is not None:
        cases += [(ten, {"kv": kv[:8], "swa": swa[:11]}), (ten, {"kv": kv[:8], "swa": swa})]
    if state is not None:
        cases += [(ten, {"kv": kv[:8], "state": state[:2]}),
                  (ten[:39], {"kv": kv[:9], "state": state[:1]}),
                  (ten[:2], {"kv": [], "state": state[:1]})]
    return cases


@pytest.mark.parametrize("config", [HYBRID, SWA_ONLY, FULL_ONLY], ids=["hybrid", "swa", "full"])
def test_tensors_and_arrays_are_refused_alike(config: dict) -> None:
    s = store(config)
    put(s, toks(2 * PAGE))
    for prompt, given in _cases(s):
        as_tensors = {k: torch.tensor(v, dtype=torch.long) for k, v in given.items()}
        fast = _error(s, prompt, **as_tensors)
        as_arrays = {k: np.array(v, dtype=np.int64) for k, v in given.items()}
        checked = _error(s, prompt, **as_arrays)  # (not a tensor: the checked path)
        assert fast == checked, (given, fast, checked)


def test_a_good_tensor_insert_after_refusals_still_stores() -> None:
    s = store(HYBRID)
    put(s, toks(2 * PAGE))
    _cases(s)
    got = s.allocate({"kv": 8, "swa": 8, "state": 1})
    assert got is not None
    done = s.insert(np.arange(40, dtype=np.int64), kv=got["kv"], swa=got.blocks["swa"],
                    state=got.blocks["state"])
    assert done.stored and done.new_pages == 8 and done.checkpoint
    s.check_integrity()
