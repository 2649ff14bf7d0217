"""The HTTP service around a TierStore (``tierstore serve``)."""
