"""Service mode: the replay's target is a running ``tierstore serve``, reached through the
HTTP client. The server must run the same (scaled) layout — start it with
``tierstore serve --model M --page-size P --scale N`` — which the target checks first.

A lookup is ``/v1/match`` with ``lock`` (the lease is held until the request completes) and,
with verification, ``/v1/fetch`` of the hit, whose envelopes must equal the payloads the replay
wrote; completion is ``/v1/insert`` of the prompt's full pages, then ``/v1/release``. Counters
come from ``/v1/stats`` (differences from the start, so a warm server is fine); latencies are
measured around each call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import numpy as np
import torch

from tierstore.client import Client, ServiceError
from tierstore.layout import ModelLayout
from tierstore.replay.scaled import payload, same_bytes
from tierstore.replay.targets import NAMESPACE, Lookup, ReplayIntegrityError

_COUNTERS = ("evictions",)


class ServiceTarget:
    """A remote tierstore service under replay (one configuration, named ``service``)."""

    def __init__(self, url: str, layout: ModelLayout, *, token: str | None = None,
                 verify: bool = True, serve_hint: str = "") -> None:
        self.name = "service"
        self.layout = layout
        self.verify = verify
        self.client = Client(url, token=token, retries=1)
        self.latency_s: dict[str, list[float]] = {"match": [], "fetch": [], "insert": []}
        self.verified = 0
        self.not_stored = 0
        # Hits are counted here, from each /v1/match answer: the verifying /v1/fetch matches
        # again on the server, so the server's own hit counters count a verified hit twice.
        self.hit_tokens = {"l1": 0, "l2": 0, "l3": 0}
        self.hit_requests = {"l1": 0, "l2": 0, "l3": 0, "miss": 0}
        try:
            stats = self.client.stats()
        except (OSError, ServiceError, aiohttp.ClientError) as exc:
            self.client.close()
            raise SystemExit(f"bench replay --url: cannot reach the service at {url}: "
                             f"{exc}") from None
        service = stats["service"]
        want = {k: e.nbytes for k, e in layout.envelopes().items()}
        if service["envelope_bytes"] != want or service["page_size"] != layout.page_size:
            self.client.close()
            raise SystemExit(
                f"bench replay --url: the service at {url} runs {service['model']} "
                f"(page {service['page_size']}, envelopes {service['envelope_bytes']}), the "
                f"replay needs page {layout.page_size}, envelopes {want}. {serve_hint}")
        self._start = stats

    def _timed(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.latency_s[what].append(time.perf_counter() - start)

    def lookup(self, tokens: np.ndarray, keys: list[bytes],
               envelopes: Mapping[str, torch.Tensor]) -> Lookup:
        query = tokens[: max(0, len(tokens) - 1)]
        m = self._timed("match", self.client.match, query, NAMESPACE, lock=True)
        tiers = {t: int(m["tiers"].get(t, 0)) for t in self.hit_tokens}
        for tier, n in tiers.items():
            self.hit_tokens[tier] += n
        deepest = next((t for t in ("l3", "l2", "l1") if tiers[t]), "miss")
        self.hit_requests[deepest] += 1
        if self.verify and m["pages"]:
            got = self._timed("fetch", self.client.fetch, query, NAMESPACE)
            self._check(int(m["pages"]), got, keys, envelopes)
        return Lookup(int(m["matched_tokens"]), int(m["pages"]), m["lease"])

    def _check(self, pages: int, got: dict[str, Any], keys: list[bytes],
               envelopes: Mapping[str, torch.Tensor]) -> None:
        def rows(blobs: list[bytes]) -> torch.Tensor:
            return torch.from_numpy(np.frombuffer(b"".join(blobs), np.uint8).reshape(
                len(blobs), -1).copy())

        checks = [("kv", rows(got["kv"][:pages]), envelopes["kv"][:pages])]
        if "swa" in envelopes:
            held = [i for i, b in enumerate(got["swa"][:pages]) if b is not None]
            if held:
                checks.append(("swa", rows([got["swa"][i] for i in held]),
                               envelopes["swa"][held]))
        if got.get("state") is not None:
            unit = self.layout.envelopes()["state"].nbytes
            checks.append(("state", rows([got["state"]]),
                           payload(keys[pages - 1: pages], "state", unit)))
        for kind, have, want in checks:
            if not same_bytes(have, want):
                raise ReplayIntegrityError(f"service: {kind} envelopes of a {pages}-page hit "
                                           f"hold the wrong bytes")
            self.verified += len(have)

    def complete(self, lookup: Lookup, tokens: np.ndarray,
                 envelopes: Mapping[str, torch.Tensor]) -> None:
        pages = len(envelopes["kv"])
        if pages:
            def blobs(kind: str) -> list[bytes] | None:
                data = envelopes.get(kind)
                return None if data is None else [row.numpy().tobytes() for row in data]

            state = blobs("state")
            result = self._timed(
                "insert", self.client.insert, tokens[: pages * self.layout.page_size],
                NAMESPACE, kv=blobs("kv"), swa=blobs("swa"), state=state[0] if state else None)
            self.not_stored += not result["stored"]
        if lookup.lease is not None:
            self.client.release(str(lookup.lease))

    def figures(self) -> dict[str, object]:
        now = self.client.stats()
        start = self._start

        def diff(key: str) -> dict[str, int]:
            return {k: int(v) - int(start[key].get(k, 0)) for k, v in now[key].items()}

        return {
            **{k: int(now[k]) - int(start[k]) for k in _COUNTERS},
            "hit_tokens": dict(self.hit_tokens), "hit_requests": dict(self.hit_requests),
            "moved_bytes": diff("moved_bytes"), "evicted_blocks": diff("evicted_blocks"),
            "not_stored": self.not_stored, "verified_envelopes": self.verified,
            "latency_ms": {what: _percentiles(v) for what, v in self.latency_s.items() if v},
        }

    def check(self) -> None:
        if not self.client.health():
            raise ReplayIntegrityError("service: /healthz failed after the replay")

    def close(self) -> None:
        self.client.close()


def _percentiles(samples: list[float]) -> dict[str, float]:
    values = np.asarray(samples) * 1000
    return {"p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90)),
            "p99": float(np.percentile(values, 99)), "n": len(values)}
