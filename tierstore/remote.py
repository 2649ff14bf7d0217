"""A blocking facade over the async Redis tier, for the synchronous store.

The store is called from engine threads (or the service's worker threads); the Redis tier is
asyncio. The bridge runs the tier on a private event-loop thread and waits on each call with a
timeout. Every failure — Redis down, a timeout, a corrupt value — comes back as a miss (False /
None / 0) and is counted; nothing raises into the store for those.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, NamedTuple, TypeVar

from remote_tier import RedisTier, RemoteTierConfig, RemoteTierError, envelope_key
from tierstore.settings import mac_secret

log = logging.getLogger(__name__)
T = TypeVar("T")


class Probe(NamedTuple):
    """What Redis holds of a run of pages: how many, from the first, have their KV envelope,
    and for each of those pages whether each other kind's envelope is there."""

    found: int
    present: dict[str, list[bool]]


class RemoteBridge:
    """L3 for one model layout: envelope keys ``{prefix}:{layout_fp}:{page_key}:{kind}``.

    Values are authenticated with ``config.mac_key``, or when it is None with the secret
    ``settings.mac_secret`` finds (``TIERSTORE_MAC_KEY_FILE``, ``TIERSTORE_MAC_KEY``, else
    this user's key file); a bad one raises ``MacKeyError`` here, before any I/O."""

    def __init__(self, config: RemoteTierConfig, layout_fingerprint: str) -> None:
        if config.mac_key is None:
            config = dataclasses.replace(config, mac_key=mac_secret())
        self.config = config
        self.layout_fp = layout_fingerprint
        self.failures = 0  # calls that timed out or failed (each is also a miss)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierstore-l3",
                                        daemon=True)
        self._thread.start()
        self._tier = RedisTier(config)
        self._run(self._tier.start(), None)  # a down server is retried on later calls
        log.info("L3 on %s (%s), prefix %r", config.redacted_url, config.mode, config.key_prefix)

    def key(self, page_key: bytes, kind: str) -> str:
        """The Redis key of one envelope of a page (``kind``: kv, swa, state)."""
        return envelope_key(self.config.key_prefix, self.layout_fp, page_key.hex(), kind)

    def put(self, items: Sequence[tuple[str, Any]]) -> list[bool]:
        """Write ``(key, payload)`` pairs, parent first; True where acknowledged."""
        if not items:
            return []
        result = self._run(self._tier.put_many(items), [False] * len(items))
        return result

    def get(self, keys: Sequence[str], timeout: float | None = None
            ) -> list[memoryview | None] | None:
        """Payloads of ``keys`` (None for a key Redis does not have, or holds damaged); None
        for the whole call when it failed or ran past ``timeout`` seconds."""
        if not keys:
            return []
        return self._run(self._tier.get_many(keys), None, timeout)

    def submit_get(self, keys: Sequence[str]) -> concurrent.futures.Future[Any]:
        """Start a get in the background; the future's result is as :meth:`get`'s."""
        return asyncio.run_coroutine_threadsafe(self._tier.get_many(list(keys)), self._loop)

    def exists_prefix(self, keys: Sequence[str], timeout: float | None = None) -> int:
        """How many of ``keys``, from the first, exist (0 on failure or past ``timeout``)."""
        return self._run(self._tier.exists_prefix(keys), 0, timeout) if keys else 0

    def exists_each(self, keys: Sequence[str], timeout: float | None = None
                    ) -> list[bool] | None:
        """Presence of each key (one batched probe); None when the call failed or ran past
        ``timeout`` seconds."""
        return self._run(self._tier.exists_many(keys), None, timeout) if keys else []

    def probe(self, page_keys: Sequence[bytes], kinds: Sequence[str],
              timeout: float | None = None) -> Probe | None:
        """:class:`Probe` of ``page_keys`` (``kinds``: the kinds besides KV to check); None when
        the call failed or ran past ``timeout`` seconds."""
        return self._run(self._probe(page_keys, kinds), None, timeout)

    def submit_probe(self, page_keys: Sequence[bytes], kinds: Sequence[str]
                     ) -> concurrent.futures.Future[Probe]:
        """Start :meth:`probe` in the background (no timeout: the caller polls the future)."""
        return asyncio.run_coroutine_threadsafe(self._probe(page_keys, kinds), self._loop)

    async def _probe(self, page_keys: Sequence[bytes], kinds: Sequence[str]) -> Probe:
        found = await self._tier.exists_prefix([self.key(k, "kv") for k in page_keys])
        present = {kind: await self._tier.exists_many([self.key(k, kind)
                                                       for k in page_keys[:found]])
                   if found else [] for kind in kinds}
        return Probe(found, present)

    def ping(self) -> bool:
        """Whether Redis answers now (an open circuit answers False without I/O)."""
        return bool(self._run(self._tier.ping(), False))

    def delete(self, keys: Sequence[str]) -> int:
        return self._run(self._tier.delete_many(keys), 0) if keys else 0

    def clear(self) -> int:
        """Delete every key of this layout under the prefix."""
        return self._run(self._tier.clear(self.layout_fp), 0)

    def stats(self) -> dict[str, Any]:
        """The Redis tier's counters, plus calls the bridge gave up on."""
        out = dataclasses.asdict(self._tier.stats())
        out["breakers"] = {node: str(state) for node, state in out["breakers"].items()}
        out["bridge_failures"] = self.failures
        return out

    def close(self) -> None:
        """Close the connections and stop the loop thread."""
        if not self._thread.is_alive():
            return
        self._run(self._tier.aclose(), None)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def _run(self, coro: Coroutine[Any, Any, T], miss: T, timeout: float | None = None) -> T:
        limit = timeout if timeout is not None else self.config.op_timeout_s * 4 + 1
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self.failures += 1
            log.warning("L3 call timed out after %.3f s", limit)
        except (RemoteTierError, OSError) as exc:
            self.failures += 1
            log.warning("L3 call failed: %s", exc)
        return miss
