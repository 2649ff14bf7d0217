"""L2: pinned host memory holding demoted envelopes (the arena mechanism on host memory)."""

from host_tier.tier import HostTier

__all__ = ["HostTier"]
