"""A private embedded server whose memory limit models a scaled L3 capacity.

Redis spends memory beyond the envelope bytes (key, value header, allocator size classes,
dict entry), which matters for small scaled envelopes (a 6 KiB value can take 7 KiB). So the
limit is calibrated: :meth:`BoundedRedis.limit` writes a few envelopes of each kind through the
store's own L3 bridge, measures ``used_memory`` per entry, deletes them, and sets
``maxmemory`` = baseline + the entries that ``scaled_bytes`` of envelope bytes make in the
working set's kind mix, at their measured cost, with ``maxmemory-policy allkeys-lru``. Redis
then evicts on its own (approximate LRU); the store sees such an entry as an L3 miss.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from remote_tier.embedded import RedisServer

if TYPE_CHECKING:
    from tierstore.store import TierStore

log = logging.getLogger(__name__)

_SAMPLES = 32  # entries per kind written to measure Redis' memory per entry


class BoundedRedis:
    """One private server (unix socket + password, see ``remote_tier.embedded``);
    ``scaled_bytes=None`` leaves it unbounded."""

    def __init__(self, scaled_bytes: int | None) -> None:
        self.scaled_bytes = scaled_bytes
        self.server = RedisServer(private=True).start()
        self.maxmemory = 0
        self.bytes_per_entry: dict[str, float] = {}

    @property
    def url(self) -> str:
        """The server's URL for ``RemoteTierConfig`` (it carries the password: never log it)."""
        return self.server.url

    def info(self, section: str) -> dict[str, str]:
        """One ``INFO`` section as a dict of strings."""
        text = self.server.command("INFO", section).decode(errors="replace")
        return dict(re.findall(r"^([a-z_0-9]+):(.*?)\r?$", text, flags=re.MULTILINE))

    def used_memory(self) -> int:
        return int(self.info("memory")["used_memory"])

    def limit(self, store: TierStore, mix: Mapping[str, float]) -> None:
        """Calibrate and set ``maxmemory`` for ``store``'s envelopes; ``mix`` is each kind's
        share of the working set's bytes. No-op when unbounded."""
        if self.scaled_bytes is None:
            return
        remote = store.remote
        assert remote is not None, "the store has no L3"
        base = self.used_memory()
        for kind, share in mix.items():
            if share <= 0:
                continue
            unit = store.arena.spec(kind).unit_bytes
            keys = [remote.key(os.urandom(32), kind) for _ in range(_SAMPLES)]
            row = torch.zeros(unit, dtype=torch.uint8).numpy()
            before = self.used_memory()
            if not all(remote.put([(k, row) for k in keys])):
                raise RuntimeError(f"L3 calibration: Redis at {self.server.where()} refused "
                                   f"a write")
            self.bytes_per_entry[kind] = (self.used_memory() - before) / _SAMPLES
            remote.delete(keys)
        entries = {k: self.scaled_bytes * s / store.arena.spec(k).unit_bytes
                   for k, s in mix.items() if s > 0}
        budget = sum(n * self.bytes_per_entry[k] for k, n in entries.items())
        self.maxmemory = int(base + budget)
        self.server.command("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        self.server.command("CONFIG", "SET", "maxmemory", str(self.maxmemory))
        log.info("L3 limit %d B (%d B of envelopes; per entry %s)", self.maxmemory,
                 self.scaled_bytes, self.bytes_per_entry)

    def figures(self) -> dict[str, object]:
        """Redis' own view: memory used and limit, keys evicted by the limit."""
        stats = self.info("stats")
        return {"used_memory": self.used_memory(), "maxmemory": self.maxmemory,
                "evicted_keys": int(stats.get("evicted_keys", 0)),
                "bytes_per_entry": dict(self.bytes_per_entry)}

    def close(self) -> None:
        self.server.close()
