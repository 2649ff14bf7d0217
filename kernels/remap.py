"""Virtual id -> physical slot translation (and per-token slot indices for pages)."""

from __future__ import annotations

import torch


def remap_reference(
    table: torch.Tensor, ids: torch.Tensor, *, sink: int, page_size: int = 1
) -> torch.Tensor:
    """Return ``table[ids]``; ids out of range or whose entry is negative map to ``sink``.

    With ``page_size > 1`` the result is per token: ``slot * page_size + t`` for t in the page
    (a sink page maps every token to ``sink``), shape ``[len(ids) * page_size]``.
    """
    ids = ids.to(table.device, torch.long)
    in_range = (ids >= 0) & (ids < table.numel())
    slots = table.index_select(0, ids.clamp(0, max(table.numel() - 1, 0)))
    valid = in_range & (slots >= 0)
    slots = torch.where(valid, slots, torch.full_like(slots, sink))
    if page_size == 1:
        return slots
    offs = torch.arange(page_size, device=table.device, dtype=torch.long)
    tokens = slots.unsqueeze(1) * page_size + offs
    tokens = torch.where(valid.unsqueeze(1), tokens, torch.full_like(tokens, sink))
    return tokens.reshape(-1)


def remap(table: torch.Tensor, ids: torch.Tensor, *, sink: int, page_size: int = 1) -> torch.Tensor:
    """Dispatching entry point; see :func:`remap_reference` for the contract."""
    return remap_reference(table, ids, sink=sink, page_size=page_size)
