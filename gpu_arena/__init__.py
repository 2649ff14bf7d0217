"""The unified arena: one byte buffer for KV pages, sliding-window KV and recurrent state.

Mechanism only: slots, bands, virtual ids, compaction, fences and per-layer views. It knows
nothing of tiers, prefixes or eviction policy.
"""

from gpu_arena.arena import Arena
from gpu_arena.fence import Fence
from gpu_arena.spec import ALIGN, ArenaError, IntegrityError, PoolSpec
from gpu_arena.stats import ArenaStats, PoolStats

__all__ = ["ALIGN", "Arena", "ArenaError", "ArenaStats", "Fence", "IntegrityError", "PoolSpec",
           "PoolStats"]
