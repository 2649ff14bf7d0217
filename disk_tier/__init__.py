"""The local disk tier: per-kind slabs of fixed-size, MAC'd slots in preallocated files.

``tier`` (:class:`DiskTier`: slots, free lists, the worker pool, the restart scan),
``slab`` (one file and its positional vectored I/O, O_DIRECT where the filesystem allows it)
and ``slot`` (the slot header: page key, parent key, depth, layout, generation, MAC).
"""

from disk_tier.slot import SlotMeta
from disk_tier.tier import DiskStats, DiskTier, DiskTierError, Recovered

__all__ = ["DiskStats", "DiskTier", "DiskTierError", "Recovered", "SlotMeta"]
