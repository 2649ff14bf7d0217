"""Input checks and conversions for :class:`~tierstore.store.TierStore` (mixed in).

Everything here validates before anything changes: a bad request raises a named
:class:`~tierstore.errors.TierStoreError` and leaves the store as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_arena import ArenaError
from tierstore.errors import ShapeError, TokenError
from tierstore.hashing import as_tokens
from tierstore.radix import Segment

if TYPE_CHECKING:
    from gpu_arena import Arena
    from tierstore.config import StoreConfig
    from tierstore.layout import ModelLayout

Blocks = torch.Tensor | Sequence[int] | None


class InputChecks:
    """Requires (set by TierStore): ``arena``, ``config``, ``layout``, ``kinds``, ``_owned``,
    ``_outstanding``."""

    arena: Arena
    config: StoreConfig
    layout: ModelLayout
    kinds: tuple[str, ...]
    _owned: dict[str, set[int]]
    _outstanding: dict[str, int]

    def _tokens(self, tokens: object) -> np.ndarray:
        toks = as_tokens(tokens)
        if len(toks) > self.config.max_tokens:
            raise TokenError(f"{len(toks)} tokens exceed the limit of {self.config.max_tokens}")
        return toks

    def _demand(self, demand: Mapping[str, int]) -> dict[str, int]:
        out = {}
        for kind, n in demand.items():
            if kind not in self.kinds:
                raise ShapeError(f"kind {kind!r} is not in this layout; kinds: {self.kinds}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ShapeError(f"{kind}: block count must be a non-negative int, got {n!r}")
            if n:
                out[kind] = n
        return out

    def _ids(self, kind: str, ids: Blocks) -> torch.Tensor:
        if kind not in self.kinds:
            raise ShapeError(f"kind {kind!r} is not in this layout; kinds: {self.kinds}")
        t = torch.as_tensor(ids if ids is not None else [], dtype=torch.long).reshape(-1)
        try:
            if t.numel():
                self.arena.resolve(kind, t)
        except ArenaError as exc:
            raise ShapeError(f"{kind}: {exc}") from None
        return t

    def _blocks(self, kind: str, value: Blocks) -> torch.Tensor | None:
        """Ids as a long tensor, or envelope bytes as a ``[n, unit]`` uint8 tensor."""
        if value is None:
            return None
        if kind not in self.kinds:
            raise ShapeError(f"this layout has no {kind!r} envelopes; kinds: {self.kinds}")
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            unit = self.arena.spec(kind).unit_bytes
            data = value.reshape(1, -1) if value.dim() == 1 else value
            if data.dim() != 2 or data.shape[1] != unit:
                raise ShapeError(f"{kind}: envelopes must be {unit} bytes each, got a tensor of "
                                 f"shape {tuple(value.shape)}")
            return data
        try:
            t = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ShapeError(f"{kind}: expected ids or uint8 envelopes ({exc})") from None
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() > 1:
            raise ShapeError(f"{kind}: ids must be a 1-D integer sequence, got {t.dtype} "
                             f"{tuple(t.shape)}")
        return t.to(torch.long).reshape(-1)

    def _check_counts(self, given: dict[str, torch.Tensor | None], n_pages: int,
                      n_tokens: int) -> None:
        kv, swa, state = given["kv"], given["swa"], given["state"]
        if "kv" in self.kinds and (kv is None or len(kv) != n_pages):
            got = None if kv is None else len(kv)
            raise ShapeError(f"kv: {n_pages} full pages of {self.layout.page_size} tokens need "
                             f"{n_pages} envelopes, got {got}")
        if swa is not None and len(swa) > n_pages:
            raise ShapeError(f"swa: at most {n_pages} envelopes (one per page), got {len(swa)}")
        if state is not None:
            if len(state) != 1:
                raise ShapeError(f"state: one checkpoint per insert, got {len(state)}")
            if n_tokens != n_pages * self.layout.page_size or n_pages == 0:
                raise ShapeError(f"state: a checkpoint needs a page-aligned prefix; {n_tokens} "
                                 f"tokens is not a positive multiple of {self.layout.page_size}")

    def _check_ids(self, kind: str, ids: torch.Tensor, path: list[Segment],
                   n_pages: int) -> None:
        """Given ids must be live and not already cached elsewhere."""
        ids_t = self._ids(kind, ids)
        if ids_t.unique().numel() != ids_t.numel():
            raise ShapeError(f"{kind}: repeated ids")
        if kind == "state":
            cached_here = {path[-1].node.state} if path and path[-1].pages == len(
                path[-1].node.keys) else set()
        else:
            offset = n_pages - len(ids_t)
            cached_here = set()
            pos = 0
            for seg in path:
                col = getattr(seg.node, kind)[: seg.pages]
                cached_here.update(v for j, v in enumerate(col)
                                   if pos + j >= offset and v == int(ids_t[pos + j - offset]))
                pos += seg.pages
        stolen = self._owned[kind].intersection(ids_t.tolist()) - cached_here
        if stolen:
            raise ShapeError(f"{kind}: {len(stolen)} ids already belong to other cached pages")

    def _bytes_demand(self, given: dict[str, torch.Tensor | None], path: list[Segment],
                      n_pages: int) -> dict[str, torch.Tensor]:
        """Per kind given as bytes, a mask over the given rows: which need a fresh L1 block
        (their page has no L1 copy yet)."""
        need = {}
        for kind, blocks in given.items():
            if blocks is None or blocks.dtype != torch.uint8:
                continue
            if kind == "state":
                last = path[-1] if path else None
                at_end = (sum(seg.pages for seg in path) == n_pages and last is not None
                          and last.pages == len(last.node.keys) and last.node.state >= 0)
                need[kind] = torch.tensor([not at_end])
            else:
                l1 = [v for seg in path for v in seg.node.col(kind, 1)[: seg.pages]]
                first = n_pages - len(blocks)
                need[kind] = torch.tensor([first + i >= len(l1) or l1[first + i] < 0
                                           for i in range(len(blocks))], dtype=torch.bool)
        return need

    def _store_bytes(self, kind: str, data: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
        """Write the rows of ``data`` that ``need`` marks into fresh L1 blocks; ids per row
        (-1 where the page already has an L1 copy)."""
        ids = torch.full((len(data),), -1, dtype=torch.long)
        count = int(need.sum())
        if count:
            fresh = self.arena.alloc(kind, count)
            assert fresh is not None, f"{kind}: room was made for {count} blocks"
            self.arena.write(kind, fresh, data[need].to(self.arena.device))
            self._outstanding[kind] += count
            ids[need] = fresh
        return ids
