"""L3 tier: an envelope store on Redis or Redis Cluster (mechanism only — it knows nothing of
arenas, prefixes or eviction policy).

    config = RemoteTierConfig(url="redis://127.0.0.1:6379/0", key_prefix="ts")
    async with RedisTier(config) as tier:
        key = envelope_key("ts", layout_fp, page_hash_hex, "kv")
        ok = await tier.put_many([(key, payload)])          # list[bool]
        (view,) = await tier.get_many([key])               # memoryview | None
        (view,) = await tier.get_many([key], out=[slot])   # received straight into slot
        n = await tier.exists_prefix(keys)                 # leading hits, stops at a miss

Files: ``config`` (``RemoteTierConfig``), ``errors`` (the exception hierarchy), ``keys`` (key
layout), ``wire`` (header + checksum, whole or split values), ``breaker`` (circuit breaker),
``resp`` (the RESP2 data connection), ``pool`` (connections per node), ``topology``
(standalone / cluster slot map via redis-py), ``transfer`` (batches to one node), ``buffers``
(receive buffer reuse), ``router`` (key → node, per-key commands over all nodes), ``split``
(a payload as parts, and parts back into a payload), ``writes`` (a put batch, parts before
heads), ``reads`` (a get batch's bookkeeping), ``stats`` (counters), ``store``
(``RedisTier``). The embedded server: ``embedded`` (find the binary, start a private or a
loopback server), ``embedded_cluster`` (three of them as a cluster), ``lifetime`` (children
that die with this process, directories of dead owners swept).
"""

from remote_tier.config import RemoteTierConfig
from remote_tier.errors import (
    BadKey,
    CorruptValue,
    RemoteTierError,
    RemoteUnavailable,
    ServerError,
    ValueTooLarge,
)
from remote_tier.keys import envelope_key, raw_key
from remote_tier.stats import RemoteTierStats
from remote_tier.store import RedisTier

__all__ = [
    "BadKey",
    "CorruptValue",
    "RedisTier",
    "RemoteTierConfig",
    "RemoteTierError",
    "RemoteTierStats",
    "RemoteUnavailable",
    "ServerError",
    "ValueTooLarge",
    "envelope_key",
    "raw_key",
]
