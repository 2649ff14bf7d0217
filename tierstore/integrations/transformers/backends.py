"""Where a transformers prefix is kept: an embedded :class:`TierStore` or a running service.

Both answer the same two calls with :class:`Envelopes`: ``put`` caches the page-aligned prefix
``tokens`` (KV pages, SWA pages, the recurrent checkpoint at its end); ``get`` returns the
longest usable cached prefix of ``tokens`` under the hybrid match rule (promoting it from the
host tier or Redis as the store does), or ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierstore.client import Client
from tierstore.integrations.transformers.codec import Envelopes
from tierstore.store import TierStore

__all__ = ["Fetched", "LibraryBackend", "PrefixBackend", "ServiceBackend"]


@dataclass(frozen=True)
class Fetched:
    """A cached prefix: its length in tokens, its envelopes and where it came from (matched
    tokens by tier, ``{"l1": .., "l2": .., "l3": ..}``)."""

    tokens: int
    envelopes: Envelopes
    tiers: dict[str, int]


class PrefixBackend(Protocol):
    """What :class:`~tierstore.integrations.transformers.PrefixCache` needs of a store."""

    def put(self, tokens: Sequence[int], envelopes: Envelopes) -> bool:
        """Cache the prefix; False when the store had no room (nothing changed)."""

    def get(self, tokens: Sequence[int]) -> Fetched | None:
        """The longest usable cached prefix of ``tokens``; None when nothing is usable."""


class LibraryBackend:
    """An embedded store: envelopes are copied into it, and out of a prefix read that is
    closed (lease and fences released) as soon as the rows are copied."""

    def __init__(self, store: TierStore, namespace: str = "default") -> None:
        self.store = store
        self.namespace = namespace

    def put(self, tokens: Sequence[int], envelopes: Envelopes) -> bool:
        """Insert the envelope bytes (pages already cached are kept, the copies freed)."""
        result = self.store.insert(list(tokens), self.namespace, kv=envelopes.kv,
                                   swa=envelopes.swa, state=envelopes.state)
        return result.stored

    def get(self, tokens: Sequence[int]) -> Fetched | None:
        """Match (promoting into L1) and copy the matched rows out."""
        with self.store.read_prefix(list(tokens), self.namespace) as read:
            match = read.match
            if match.tokens == 0:
                return None
            rows = read.rows
            swa = rows.get("swa")
            if swa is not None:  # the window's pages end the prefix; earlier ones may be gone
                swa = swa[max(0, match.pages - self.store.layout.swa_window_pages()):]
            envelopes = Envelopes(_stacked(rows.get("kv")), _stacked(swa),
                                  _stacked(rows.get("state")))
        return Fetched(match.tokens, envelopes, dict(match.tiers))


class ServiceBackend:
    """A running ``tierstore serve`` through the blocking :class:`~tierstore.client.Client`
    (``/v1/insert`` and ``/v1/fetch``)."""

    def __init__(self, client: Client, namespace: str = "default") -> None:
        self.client = client
        self.namespace = namespace

    def put(self, tokens: Sequence[int], envelopes: Envelopes) -> bool:
        """POST the envelope bytes to ``/v1/insert``."""
        reply = self.client.insert(
            list(tokens), self.namespace, kv=_blobs(envelopes.kv),
            swa=_blobs(envelopes.swa) if envelopes.swa is not None else None,
            state=_blobs(envelopes.state)[0] if envelopes.state is not None else None)
        return bool(reply["stored"])

    def get(self, tokens: Sequence[int]) -> Fetched | None:
        """``/v1/fetch``: the matched prefix's bytes (the service promotes and releases)."""
        reply: dict[str, Any] = self.client.fetch(list(tokens), self.namespace)
        if not reply["matched_tokens"]:
            return None
        kv = _rows(reply["kv"]) if reply["kv"] else None
        trailing: list[bytes] = []  # the window's pages end the list; tombstones precede them
        for blob in reversed(reply["swa"]):
            if blob is None:
                break
            trailing.insert(0, blob)
        swa = _rows(trailing) if trailing else None
        state = _rows([reply["state"]]) if reply["state"] is not None else None
        return Fetched(int(reply["matched_tokens"]), Envelopes(kv, swa, state),
                       dict(reply.get("tiers") or {}))


def _stacked(rows: Sequence[torch.Tensor | None] | None) -> torch.Tensor | None:
    """A copy of arena rows as ``[n, bytes]`` (valid after the read is closed)."""
    if not rows:
        return None
    assert all(row is not None for row in rows), "a match returned a window with SWA holes"
    return torch.stack([row for row in rows if row is not None]).cpu()


def _blobs(rows: torch.Tensor | None) -> list[bytes]:
    return [] if rows is None else [bytes(row.numpy().tobytes()) for row in rows.cpu()]


def _rows(blobs: Sequence[bytes]) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs])
