"""Input checks and conversions for :class:`~tierstore.store.TierStore`: plain functions.

Everything here validates before anything changes: a bad request raises a named
:class:`~tierstore.errors.TierStoreError` and leaves the store as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tierstore.errors import ShapeError, TokenError
from tierstore.hashing import as_tokens
from tierstore.ledger import Ledger
from tierstore.radix import CHECKPOINT, Segment, Tier

Blocks = torch.Tensor | Sequence[int] | None


def tokens(value: object, max_tokens: int) -> np.ndarray:
    """Token ids as one uint32 array (see :func:`~tierstore.hashing.as_tokens`), at most
    ``max_tokens`` of them."""
    toks = as_tokens(value)
    if len(toks) > max_tokens:
        raise TokenError(f"{len(toks)} tokens exceed the limit of {max_tokens}")
    return toks


def demand(kinds: Sequence[str], value: Mapping[str, int]) -> dict[str, int]:
    """``{kind: blocks}`` with every kind in the layout and every count a non-negative int;
    zero counts dropped."""
    out = {}
    for kind, n in value.items():
        if type(n) is int and n > 0 and kind in kinds:  # the common case, checked at once
            out[kind] = n
            continue
        if kind not in kinds:
            raise ShapeError(f"kind {kind!r} is not in this layout; kinds: {tuple(kinds)}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ShapeError(f"{kind}: block count must be a non-negative int, got {n!r}")
        if n:
            out[kind] = n
    return out


def ids(kind: str, kinds: Sequence[str], value: Blocks) -> list[int]:
    """Block ids of ``kind`` as a list of ints (1-D integer input only)."""
    if kind not in kinds:
        raise ShapeError(f"kind {kind!r} is not in this layout; kinds: {tuple(kinds)}")
    t = blocks(kind, kinds, value if value is not None else [], unit_bytes=None)
    assert t is not None
    return t.tolist()


def blocks(kind: str, kinds: Sequence[str], value: object, unit_bytes: int | None
           ) -> torch.Tensor | None:
    """Ids as a long tensor, or (``unit_bytes`` given) envelope bytes as a ``[n, unit]`` uint8
    tensor."""
    if value is None:
        return None
    if kind not in kinds:
        raise ShapeError(f"this layout has no {kind!r} envelopes; kinds: {tuple(kinds)}")
    if isinstance(value, torch.Tensor) and value.dtype == torch.long and value.dim() == 1:
        return value  # ids as allocate returns them
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and unit_bytes:
        data = value.reshape(1, -1) if value.dim() == 1 else value
        if data.dim() != 2 or data.shape[1] != unit_bytes:
            raise ShapeError(f"{kind}: envelopes must be {unit_bytes} bytes each, got a tensor "
                             f"of shape {tuple(value.shape)}")
        return data
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ShapeError(f"{kind}: expected ids or uint8 envelopes ({exc})") from None
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex or t.dim() > 1:
        raise ShapeError(f"{kind}: ids must be a 1-D integer sequence, got {t.dtype} "
                         f"{tuple(t.shape)}")
    return t.to(torch.long).reshape(-1)


def counts(given: Mapping[str, torch.Tensor | None], kinds: Sequence[str], page_size: int,
           n_pages: int, n_tokens: int, cached: int) -> None:
    """The shapes an insert accepts: ``kv`` for the trailing pages at least past what the
    index holds (``cached`` pages), ``swa`` for at most every page, one page-aligned state."""
    kv, swa, state = given["kv"], given["swa"], given["state"]
    if "kv" in kinds:
        got = 0 if kv is None else kv.shape[0]  # (len() of a tensor costs more)
        if got > n_pages or got < n_pages - cached:
            need = (f"{n_pages} envelopes" if cached == 0
                    else f"{n_pages - cached} to {n_pages} envelopes (the first {cached} "
                         f"pages are cached)")
            raise ShapeError(f"kv: {n_pages} full pages of {page_size} tokens need {need}, "
                             f"got {got}")
    if swa is not None and swa.shape[0] > n_pages:
        raise ShapeError(f"swa: at most {n_pages} envelopes (one per page), got {len(swa)}")
    if state is not None:
        if state.shape[0] != 1:
            raise ShapeError(f"state: one checkpoint per insert, got {len(state)}")
        if n_tokens != n_pages * page_size or n_pages == 0:
            raise ShapeError(f"state: a checkpoint needs a page-aligned prefix; {n_tokens} "
                             f"tokens is not a positive multiple of {page_size}")


def owned_ids(kind: str, given: list[int], ledger: Ledger, path: list[Segment],
              n_pages: int) -> None:
    """Ids given to an insert must be the caller's (handed out by ``allocate``) or the ids
    the cache already has at those very pages (from a match)."""
    distinct = set(given)
    if len(distinct) != len(given):
        raise ShapeError(f"{kind}: repeated ids")
    handed = ledger.handed[kind]
    if handed.issuperset(distinct):  # the common case: ids fresh from allocate
        return
    foreign = [i for i in given if i not in handed]
    here = set()
    if kind == CHECKPOINT:  # the cached checkpoint at exactly this prefix's end
        last = path[-1] if path else None
        if (last is not None and last.pages == len(last.node.keys)
                and last.node.end == n_pages):
            here.add(last.node.checkpoint(Tier.L1))
    else:
        offset, pos = n_pages - len(given), 0
        for seg in path:
            col = seg.node.ids(Tier.L1, kind)
            here.update(v for j, v in enumerate(col[: seg.pages])
                        if pos + j >= offset and v == given[pos + j - offset])
            pos += seg.pages
    stolen = [i for i in foreign if i not in here]
    if stolen:
        in_cache = ledger.cached(kind)
        cached = sum(i in in_cache for i in stolen)
        if cached:
            raise ShapeError(f"{kind}: {cached} ids already belong to other cached pages")
        raise ShapeError(f"{kind}: {len(stolen)} ids are not live blocks handed out by "
                         f"allocate, first {stolen[0]}")


def bytes_demand(given: Mapping[str, torch.Tensor | None], path: list[Segment], n_pages: int
                 ) -> dict[str, list[bool]]:
    """Per kind given as bytes, a mask over the given rows: which need a fresh L1 block
    (their page has no L1 copy yet)."""
    need: dict[str, list[bool]] = {}
    for kind, data in given.items():
        if data is None or data.dtype != torch.uint8:
            continue
        if kind == CHECKPOINT:
            last = path[-1] if path else None
            at_end = (sum(seg.pages for seg in path) == n_pages and last is not None
                      and last.pages == len(last.node.keys)
                      and last.node.checkpoint(Tier.L1) >= 0)
            need[kind] = [not at_end]
        else:
            l1 = [v for seg in path for v in seg.node.ids(Tier.L1, kind)[: seg.pages]]
            first = n_pages - len(data)
            need[kind] = [first + i >= len(l1) or l1[first + i] < 0 for i in range(len(data))]
    return need
