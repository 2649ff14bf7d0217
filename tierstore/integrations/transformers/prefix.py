"""Prefill a transformers model through tierstore: reuse the longest cached prefix, compute the
rest, and cache a checkpoint at the last page boundary before the final prompt token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from tierstore.integrations.transformers.backends import PrefixBackend
from tierstore.integrations.transformers.codec import CacheCodec, model_layout
from tierstore.layout import ModelLayout

__all__ = ["Prefilled", "PrefixCache", "Restored"]


@dataclass
class Restored:
    """A cache holding the first ``tokens`` tokens (0: a fresh cache), and the matched tokens
    by tier it came from."""

    tokens: int
    cache: DynamicCache
    tiers: dict[str, int] = field(default_factory=dict)


@dataclass
class Prefilled:
    """One prompt's prefill: logits of positions ``[cached_tokens, len(prompt))``, the cache
    after the whole prompt (for decoding on), and whether a checkpoint was cached."""

    logits: torch.Tensor  # [len(prompt) - cached_tokens, vocab], float32
    cache: DynamicCache  # sliding layers back to keeping window - 1 tokens
    cached_tokens: int
    saved_tokens: int  # the page-aligned prefix handed to the store (0: none)
    tiers: dict[str, int] = field(default_factory=dict)


class PrefixCache:
    """A transformers causal LM whose prompt prefixes are kept in tierstore.

    ``backend`` is a :class:`LibraryBackend` (embedded store) or :class:`ServiceBackend`
    (``tierstore serve``); its layout must be :func:`model_layout` of ``model`` at the same page
    size. Batch size 1, greedy-free: callers pick tokens from the logits themselves.
    """

    def __init__(self, model: Any, backend: PrefixBackend, layout: ModelLayout | None = None,
                 *, page_size: int = 16) -> None:
        self.model = model
        self.backend = backend
        self.layout = layout or model_layout(model, page_size=page_size)
        self.codec = CacheCodec(self.layout, model.config)
        self.device = next(model.parameters()).device

    def restore(self, tokens: Sequence[int]) -> Restored:
        """The longest cached usable prefix of ``tokens`` as a fresh cache (a lookup; the store
        records the hit)."""
        fetched = self.backend.get(tokens)
        if fetched is None:
            return Restored(0, self.codec.new_cache())
        cache = self.codec.decode(fetched.envelopes, fetched.tokens, self.device)
        return Restored(fetched.tokens, cache, fetched.tiers)

    def save(self, tokens: Sequence[int], cache: DynamicCache) -> bool:
        """Cache ``tokens`` (page-aligned, exactly what ``cache`` holds); False when the store
        had no room. The cache itself is only read."""
        return self.backend.put(tokens, self.codec.encode(cache, len(tokens)))

    @torch.no_grad()
    def prefill(self, prompt: Sequence[int]) -> Prefilled:
        """Run ``prompt`` through the model from its longest cached prefix, caching the
        checkpoint at the last page boundary before the final token (so a repeat of the prompt
        still has a token to compute)."""
        if len(prompt) < 1:
            raise ValueError("prompt must hold at least one token")
        page = self.layout.page_size
        restored = self.restore(prompt[:-1])
        start, cache = restored.tokens, restored.cache
        boundary = (len(prompt) - 1) // page * page
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        logits, saved = [], 0
        if boundary > start:
            logits.append(self._forward(ids[:, start:boundary], cache))
            saved = boundary if self.save(prompt[:boundary], cache) else 0
        logits.append(self._forward(ids[:, max(start, boundary):], cache))
        self.codec.stop_recording(cache)  # nothing more to save: a plain cache to decode on
        return Prefilled(torch.cat(logits), cache, start, saved, restored.tiers)

    def _forward(self, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0].float()
