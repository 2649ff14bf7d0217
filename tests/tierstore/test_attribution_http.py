"""Attribution through the real service: /v1/match replies, /metrics counters and /v1/stats
totals and curves all account for every prompt token."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import urllib.request
from typing import Any

import msgpack
import torch

from tierstore.attribution import Attribution
from tierstore.config import StoreConfig
from tierstore.mrc import Shadow
from tierstore.service import server
from tierstore.service.config import ServiceConfig
from tierstore.store import TierStore
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

LAYOUT = tiny_layout(page_size=4)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}


def call(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else msgpack.packb(body, use_bin_type=True)
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST")
    if body is not None:
        req.add_header("Content-Type", "application/msgpack")
    with urllib.request.urlopen(req, timeout=30) as res:
        raw = res.read()
    return raw.decode() if path == "/metrics" else json.loads(raw)


def prompt(i: int, pages: int = 4) -> list[int]:
    return list(range(1000 * i, 1000 * i + pages * LAYOUT.page_size))


def test_match_replies_metrics_and_stats_sum_to_the_prompts() -> None:
    # L1 holds ~2 prompts, L2 ~2 more, no L3: early prompts are dropped (evicted).
    per = 4 * UNITS["kv"] + 2 * UNITS["swa"] + UNITS["state"]
    store = TierStore(LAYOUT, StoreConfig(capacity_bytes=2 * per + 512,
                                          host_capacity_bytes=2 * per + 512))
    g = torch.Generator().manual_seed(0)

    def blobs(kind: str, n: int) -> list[bytes]:
        return [torch.randint(0, 256, (UNITS[kind],), dtype=torch.uint8, generator=g)
                .numpy().tobytes() for _ in range(n)]

    with RunningService(store, ServiceConfig(port=free_port(), kv_host_bytes=1 << 20)) as svc:
        for i in range(8):
            answer = call(svc.url, "/v1/insert", {"tokens": prompt(i), "kv": blobs("kv", 4),
                                                  "swa": blobs("swa", 2),
                                                  "state": blobs("state", 1)[0]})
            assert answer["stored"]
        queried = 0
        seen: set[str] = set()
        for i, extra in [(7, 3), (6, 1), (0, 2), (1, 0), (50, 5), (5, 4)]:
            tokens = prompt(i) + list(range(9000, 9000 + extra))
            reply = call(svc.url, "/v1/match", {"tokens": tokens})
            queried += len(tokens)
            assert sum(reply["tiers"].values()) == reply["matched_tokens"]
            assert reply["matched_tokens"] + sum(reply["lost"].values()) == len(tokens), reply
            assert sum(reply["evicted_from"].values()) == reply["lost"].get("evicted", 0)
            seen |= set(reply["lost"])
        assert {"evicted", "cold", "partial_page"} <= seen
        stats = call(svc.url, "/v1/stats")
        attribution = stats["attribution"]
        assert stats["tokens_queried"] == queried
        assert sum(attribution["hit"].values()) == stats["tokens_hit"]
        assert sum(attribution["hit"].values()) + sum(attribution["lost"].values()) == queried
        mrc = stats["mrc"]
        assert set(mrc["tiers"]) == {"l1", "l2"} and mrc["multiples"][0] == 0.5
        for curve in mrc["tiers"].values():
            assert all(0 <= r <= 1 for r in curve["hit_rate"])
            assert curve["hit_rate"] == sorted(curve["hit_rate"])  # more bytes never hit less
        metrics = call(svc.url, "/metrics")
        counted = 0
        for line in metrics.splitlines():
            if m := re.match(r'tierstore_prompt_tokens_total\{(.*)\} (\S+)', line):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
                assert set(labels) == {"outcome", "tier", "tenant"}
                assert labels["tenant"] == "default"
                counted += int(float(m.group(2)))
        assert counted == queried
        assert 'tierstore_mrc_hit_rate{multiple="2",tier="l1"}' in metrics


def test_accounting_switched_off_through_the_service() -> None:
    """``serve --no-attribution --no-mrc``: replies carry empty splits, stats no totals or
    curves, /metrics no prompt-token counters; the cache serves the same."""
    per = 4 * UNITS["kv"] + 2 * UNITS["swa"] + UNITS["state"]
    store = TierStore(LAYOUT, StoreConfig(capacity_bytes=2 * per + 512, attribution=False,
                                          mrc=False))
    kv = [bytes([i]) * UNITS["kv"] for i in range(4)]
    with RunningService(store, ServiceConfig(port=free_port(), kv_host_bytes=1 << 20)) as svc:
        assert call(svc.url, "/v1/insert", {"tokens": prompt(1), "kv": kv,
                                            "swa": [bytes(UNITS["swa"])] * 2,
                                            "state": bytes(UNITS["state"])})["stored"]
        reply = call(svc.url, "/v1/match", {"tokens": prompt(1) + [7]})
        assert reply["matched_tokens"] == len(prompt(1))
        assert reply["lost"] == {} and reply["evicted_from"] == {}
        stats = call(svc.url, "/v1/stats")
        assert stats["attribution"] is None and stats["mrc"] is None
        assert stats["tokens_hit"] == len(prompt(1))
        metrics = call(svc.url, "/metrics")
        assert "tierstore_prompt_tokens_total{" not in metrics
        assert "tierstore_mrc_hit_rate{" not in metrics


def test_serve_flags_switch_the_accounting_off() -> None:
    """``tierstore serve --no-attribution --no-mrc`` builds a store with null parts."""
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    common = ["--no-redis", "--device", "cpu", "--l1", "1MiB", "--l2", "0", "--scale",
              "1/2048", "--no-shm", "--kv-host", "1MiB"]
    for flags, attribution, mrc in (([], True, True), (["--no-attribution"], False, True),
                                    (["--no-attribution", "--no-mrc"], False, False)):
        with contextlib.ExitStack() as stack:
            service, _ = server.build(parser.parse_args(common + flags), stack)
            stack.callback(service.store.close)
            stack.callback(service.kv.close)
            config = service.store.config
            assert (config.attribution, config.mrc) == (attribution, mrc)
            assert isinstance(service.store.attribution, Attribution) == attribution
            assert isinstance(service.store.mrc, Shadow) == mrc
