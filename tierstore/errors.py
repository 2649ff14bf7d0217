"""The exception root of tierstore and its tier packages, and its families.

Every public error of ``tierstore``, ``gpu_arena``, ``host_tier``, ``remote_tier`` and
``kernels`` derives from :class:`TierStoreError`, through one family that says what the caller
can do about it:

- :class:`UsageError` (a ``ValueError``): caller misuse; the message names the key or numbers.
  Fix the call; nothing changed.
- :class:`UnavailableError`: a part the call needs (a tier, the service, shared memory) cannot
  be reached now; retry or fall back. Subclasses keep the ``OSError`` / ``RuntimeError`` their
  callers catch.
- :class:`InternalError` (an ``AssertionError``): an invariant broke, a bug in tierstore rather
  than in the call. It stays an ``AssertionError`` so that test runners and ``check_integrity``
  callers see it as one; catch :class:`UsageError` or :class:`UnavailableError`, not the root,
  where a bug must not pass for a miss.

Package families (``RemoteTierError``, ``ServiceError``, ``HTTPError``) derive from the root
directly or through one of these.

This module imports nothing, and ``tierstore/__init__`` imports nothing at load, so the lower
packages import their root from here without loading the store above them.
"""

from __future__ import annotations


class TierStoreError(Exception):
    """Root of every error tierstore and its tier packages raise."""


class UsageError(TierStoreError, ValueError):
    """Caller misuse (bad arguments, input or configuration); nothing changed."""


class UnavailableError(TierStoreError):
    """A part the call needs cannot be reached now; retry or fall back."""


class InternalError(TierStoreError, AssertionError):
    """An internal invariant broke: a bug, not a misuse."""


class TokenError(UsageError):
    """Token ids are not a 1-D sequence of non-negative integers that fit in uint32."""


class NamespaceError(UsageError):
    """A namespace string is malformed."""


class ShapeError(UsageError):
    """Envelopes or ids do not match the model layout (count, kind or byte size)."""


class LeaseError(UsageError):
    """A lease was released twice or does not belong to this store."""
