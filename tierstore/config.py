"""Frozen, validated configuration of a store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from remote_tier import RemoteTierConfig
from tierstore.eviction import POLICIES, PolicyName, StopRule
from tierstore.hashing import HashName

SwaRetention = Literal["auto", "all", "window"]
WritePolicy = Literal["write_back", "write_through", "write_through_selective"]
Prefetch = Literal["wait", "timeout", "best_effort"]


@dataclass(frozen=True)
class StoreConfig:
    """How a :class:`~tierstore.store.TierStore` is built and behaves.

    ``swa_retention``: ``window`` keeps only the SWA pages inside the window before a state
    checkpoint (the only place a hybrid match can end); ``all`` keeps every SWA page (models
    without recurrent state can match at any page); ``auto`` picks by the layout.

    Tiers: ``host_capacity_bytes > 0`` adds L2 (host memory); ``disk_path`` with
    ``disk_size_bytes`` adds the local disk tier below it; ``remote`` adds L3 (Redis).
    ``write_policy``: ``write_back`` copies down only on eviction, ``write_through`` on insert,
    ``write_through_selective`` once a prefix has ``write_through_hits`` hits. ``prefetch`` is
    how a match waits for L3: ``wait`` (up to the Redis op timeout), ``timeout`` (up to
    ``prefetch_timeout_s``, then serve what is in L1/L2), ``best_effort`` (never block on L3).
    """

    capacity_bytes: int
    device: str = "cpu"
    eviction: PolicyName = "lru"
    stop_rule: StopRule = "unified"
    hash_algorithm: HashName = "sha256"
    swa_retention: SwaRetention = "auto"
    max_tokens: int = 1 << 20
    host_capacity_bytes: int = 0
    remote: RemoteTierConfig | None = None
    write_policy: WritePolicy = "write_back"
    write_through_hits: int = 2
    prefetch: Prefetch = "wait"
    prefetch_timeout_s: float = 0.05
    # A fixed split, for comparison: {kind: fraction of capacity_bytes} caps each L1 band.
    pool_shares: tuple[tuple[str, float], ...] | None = None
    # The local disk tier (between L2 and L3): a directory and the bytes of its slab files.
    # Slots are authenticated with ``disk_mac_key`` (None: the L3 secret, settings.mac_secret);
    # ``disk_direct`` None probes O_DIRECT, False forces buffered I/O.
    disk_path: str | None = None
    disk_size_bytes: int = 0
    disk_mac_key: bytes | None = field(default=None, repr=False)
    disk_direct: bool | None = None
    disk_io_threads: int = 4
    # Accounting (what a match lost and why; what more memory would buy). Off, the store
    # keeps a null part instead: no per-request cost, no ``lost`` split, no curves.
    attribution: bool = True
    mrc: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        try:
            kind = torch.device(self.device).type
        except RuntimeError as e:
            raise ValueError(f"device must be a torch device string, got {self.device!r}") from e
        if kind not in ("cpu", "cuda", "meta"):
            raise ValueError(f"device must be cpu, cuda[:N] or meta, got {self.device!r}")
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
        if self.host_capacity_bytes < 0:
            raise ValueError(f"host_capacity_bytes must be >= 0, got {self.host_capacity_bytes}")
        if self.write_policy not in ("write_back", "write_through", "write_through_selective"):
            raise ValueError(f"write_policy must be write_back / write_through / "
                             f"write_through_selective, got {self.write_policy!r}")
        if self.write_through_hits < 1:
            raise ValueError(f"write_through_hits must be >= 1, got {self.write_through_hits}")
        if self.prefetch not in ("wait", "timeout", "best_effort"):
            raise ValueError(f"prefetch must be wait / timeout / best_effort, got "
                             f"{self.prefetch!r}")
        if self.pool_shares is not None and (
                any(not 0 < share <= 1 for _, share in self.pool_shares)
                or sum(share for _, share in self.pool_shares) > 1 + 1e-9):
            raise ValueError(f"pool_shares must be fractions in (0, 1] summing to <= 1, got "
                             f"{self.pool_shares}")
        if not self.prefetch_timeout_s > 0:
            raise ValueError(f"prefetch_timeout_s must be > 0, got {self.prefetch_timeout_s}")
        if (self.disk_path is None) != (self.disk_size_bytes == 0) or self.disk_size_bytes < 0:
            raise ValueError(f"a disk tier needs both disk_path and disk_size_bytes > 0, got "
                             f"{self.disk_path!r} and {self.disk_size_bytes}")
        if self.disk_io_threads < 1:
            raise ValueError(f"disk_io_threads must be >= 1, got {self.disk_io_threads}")
