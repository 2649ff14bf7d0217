"""The remote tier's one exception hierarchy; Redis errors are translated into it here.

Channels (STYLE §5): a down/slow/refusing server is *not* raised into data-path callers — it
becomes a miss (``get``) or ``False`` (``put``) plus a counter. What is raised is caller misuse
(``BadKey``, ``ValueTooLarge``, both also ``ValueError``) and, from admin calls such as
``clear()``, ``RemoteUnavailable``.
"""

from __future__ import annotations

from typing import Literal

import redis.exceptions

from tierstore.errors import TierStoreError, UnavailableError

UnavailableReason = Literal["connection", "timeout", "circuit_open", "auth", "topology"]


class RemoteTierError(TierStoreError):
    """Base of every error the remote tier raises."""


class RemoteUnavailable(RemoteTierError, UnavailableError):
    """The server (or cluster node) cannot be used now: down, timed out, or circuit open."""

    def __init__(self, reason: UnavailableReason, detail: str = "") -> None:
        super().__init__(f"redis unavailable ({reason}){': ' + detail if detail else ''}")
        self.reason: UnavailableReason = reason


class ServerError(RemoteTierError):
    """The server answered with an error reply (``-ERR``, ``-OOM``, ``-WRONGTYPE`` …)."""


class Moved(ServerError):
    """A cluster node redirected a key (``-MOVED``/``-ASK``): the slot map is stale."""


class ProtocolError(RemoteTierError):
    """The byte stream from the server is not valid RESP; the connection is dropped."""


class CorruptValue(RemoteTierError):
    """A stored value failed a header, length or checksum check (the caller sees a miss)."""


class OldFormat(CorruptValue):
    """A value written in a wire format this version no longer reads (read as a miss)."""


class BadKey(RemoteTierError, ValueError):
    """A key or key part is malformed or outside this tier's prefix."""


class ValueTooLarge(RemoteTierError, ValueError):
    """A value cannot be stored: one Redis value would exceed ``max_value_bytes`` (only
    possible with ``chunk_bytes`` 0), or it would need more than ``wire.MAX_PARTS`` parts.
    Nothing of the batch was written."""


def server_error(message: str) -> ServerError:
    """The typed error for an error reply's text (``MOVED``/``ASK`` become ``Moved``)."""
    if message.startswith(("MOVED ", "ASK ")):
        return Moved(message)
    return ServerError(message)


def translate(exc: BaseException) -> RemoteTierError:
    """Map a redis-py exception (admin/topology path) onto this hierarchy."""
    if isinstance(exc, RemoteTierError):
        return exc
    if isinstance(exc, (redis.exceptions.TimeoutError, TimeoutError)):
        return RemoteUnavailable("timeout", str(exc))
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return RemoteUnavailable("auth", str(exc))
    if isinstance(exc, (redis.exceptions.ConnectionError, OSError)):
        return RemoteUnavailable("connection", str(exc))
    if isinstance(exc, redis.exceptions.RedisClusterException):
        return RemoteUnavailable("topology", str(exc))
    if isinstance(exc, redis.exceptions.ResponseError):
        return server_error(str(exc))
    return RemoteTierError(f"{type(exc).__name__}: {exc}")
