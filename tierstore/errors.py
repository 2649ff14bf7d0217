"""The store's exception hierarchy: caller misuse gets a named error with the numbers."""

from __future__ import annotations


class TierStoreError(ValueError):
    """Base of every error tierstore raises for caller misuse."""


class TokenError(TierStoreError):
    """Token ids are not a 1-D sequence of non-negative integers that fit in uint32."""


class NamespaceError(TierStoreError):
    """A namespace string is malformed."""


class ShapeError(TierStoreError):
    """Envelopes or ids do not match the model layout (count, kind or byte size)."""


class LeaseError(TierStoreError):
    """A lease was released twice or does not belong to this store."""
