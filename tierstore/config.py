"""Frozen, validated configuration of a store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tierstore.eviction import POLICIES, PolicyName, StopRule
from tierstore.hashing import HashName

SwaRetention = Literal["auto", "all", "window"]


@dataclass(frozen=True)
class StoreConfig:
    """How a :class:`~tierstore.store.TierStore` is built and behaves.

    ``swa_retention``: ``window`` keeps only the SWA pages inside the window before a state
    checkpoint (the only place a hybrid match can end); ``all`` keeps every SWA page (models
    without recurrent state can match at any page); ``auto`` picks by the layout.
    """

    capacity_bytes: int
    device: str = "cpu"
    eviction: PolicyName = "lru"
    stop_rule: StopRule = "unified"
    hash_algorithm: HashName = "sha256"
    swa_retention: SwaRetention = "auto"
    max_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {self.eviction!r}")
        if self.stop_rule not in ("unified", "per_kind"):
            raise ValueError(f"stop_rule must be 'unified' or 'per_kind', got {self.stop_rule!r}")
        if self.hash_algorithm not in ("sha256", "xxh3"):
            raise ValueError(f"hash_algorithm must be 'sha256' or 'xxh3', got "
                             f"{self.hash_algorithm!r}")
        if self.swa_retention not in ("auto", "all", "window"):
            raise ValueError(f"swa_retention must be auto/all/window, got {self.swa_retention!r}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
