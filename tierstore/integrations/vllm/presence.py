"""What the tier believes the service holds, so that ``lookup`` never waits on the network.

The scheduler thread reads verdicts and queues unknown keys; one probe thread asks the service
about queued keys in batches (``batch_exists``, one request per ``probe_batch`` keys) and
records the answers. Verdicts age out (``present_ttl_s`` / ``absent_ttl_s``): a block evicted
by the service, or stored by another engine, is seen again after that long. The tier's own
stores and loads update verdicts as they finish.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

log = logging.getLogger(__name__)

Verdict = Literal["present", "absent", "unknown"]
Probe = Callable[[Sequence[bytes]], list[bool] | None]


class PresenceCache:
    """Presence verdicts per key plus a queue of keys to probe (thread-safe).

    ``probe(keys)`` answers per key whether the service holds it, or None when it could not
    ask (service down): those keys count as absent for ``absent_ttl_s`` (a miss, never a
    request held waiting for the service).
    """

    def __init__(self, probe: Probe, *, present_ttl_s: float, absent_ttl_s: float,
                 batch: int, max_entries: int = 1 << 21) -> None:
        self._probe = probe
        self.present_ttl_s = present_ttl_s
        self.absent_ttl_s = absent_ttl_s
        self.batch = batch
        self.max_entries = max_entries
        self._lock = threading.Condition()
        self._verdicts: dict[bytes, tuple[bool, float]] = {}  # key -> (present, expires)
        self._queued: dict[bytes, None] = {}  # insertion-ordered set
        self._probing: set[bytes] = set()
        self._closed = False
        self.num_probed = 0
        self.num_probe_failures = 0
        self._thread = threading.Thread(target=self._run, name="tierstore-vllm-probe",
                                        daemon=True)
        self._thread.start()

    def verdict(self, key: bytes) -> Verdict:
        """``present`` / ``absent`` while a fresh verdict holds; else ``unknown``, and the key
        is queued for the next probe batch. Never blocks on I/O."""
        now = time.monotonic()
        with self._lock:
            found = self._verdicts.get(key)
            if found is not None and found[1] > now:
                return "present" if found[0] else "absent"
            if key not in self._queued and key not in self._probing:
                self._queued[key] = None
                self._lock.notify()
            return "unknown"

    def mark(self, keys: Sequence[bytes], present: bool) -> None:
        """Record what a finished store or load showed about ``keys``."""
        expires = time.monotonic() + (self.present_ttl_s if present else self.absent_ttl_s)
        with self._lock:
            self._trim(len(keys))
            for key in keys:
                self._verdicts[key] = (present, expires)

    def is_present(self, key: bytes) -> bool:
        """Whether a fresh verdict says ``key`` is stored (no probe is queued)."""
        found = self._verdicts.get(key)
        return found is not None and found[0] and found[1] > time.monotonic()

    def idle(self) -> bool:
        """No key queued or being probed."""
        with self._lock:
            return not self._queued and not self._probing

    def close(self) -> None:
        """Stop the probe thread (queued keys are dropped)."""
        with self._lock:
            self._closed = True
            self._queued.clear()
            self._lock.notify_all()
        self._thread.join(timeout=10)

    def _trim(self, incoming: int) -> None:
        """Forget the oldest verdicts beyond ``max_entries`` (a dict keeps insertion order)."""
        excess = len(self._verdicts) + incoming - self.max_entries
        if excess > 0:
            for key in list(self._verdicts)[:excess]:
                del self._verdicts[key]

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                keys = list(self._queued)[:self.batch]
                for key in keys:
                    del self._queued[key]
                self._probing.update(keys)
            try:
                found = self._probe(keys)
            except Exception:  # the thread must survive anything a probe raises
                log.warning("tierstore vLLM tier: probe of %d keys failed", len(keys),
                            exc_info=True)
                found = None
            with self._lock:
                self._probing.difference_update(keys)
                self.num_probed += len(keys)
                if found is None or len(found) != len(keys):
                    # Unanswered is absent (for absent_ttl_s): RETRY until the service is back
                    # would hold vLLM's requests; a miss lets it recompute now.
                    self.num_probe_failures += 1
                    found = [False] * len(keys)
                now = time.monotonic()
                self._trim(len(keys))
                for key, present in zip(keys, found, strict=True):
                    ttl = self.present_ttl_s if present else self.absent_ttl_s
                    self._verdicts[key] = (present, now + ttl)
