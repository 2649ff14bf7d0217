"""The replay loop: requests arrive in trace order, look their prompt up, and cache it when
they complete.

Time model: request ``i`` arrives at its trace timestamp and completes ``output_length *
decode_s_per_token`` seconds later (decode at a fixed per-request rate; prefill time is not
modelled, so completion does not depend on the hit rate and every configuration sees the same
order of events). Before a request is looked up, every request that completed by its arrival
time inserts its prompt, in completion order; a request's matched prefix stays locked (its
lease held) until it completes. The arena is all cache: running requests' own KV is not
allocated from it.

Each request inserts its prompt's full pages (one 512-token trace block is one page at the
default page size) with, for layouts with recurrent state, one checkpoint at the last full
page — as engines checkpoint where a prompt's prefill stops. The hybrid match rule decides what
a later request can use. Envelope payloads are derived from page keys (``scaled.payload``) once
per request and shared by every configuration.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from tierstore.hashing import PageHasher
from tierstore.layout import ModelLayout
from tierstore.replay.blocks import request_tokens
from tierstore.replay.scaled import payload
from tierstore.replay.targets import NAMESPACE, Lookup, ReplayTarget
from tierstore.replay.trace import TraceRequest


@dataclass
class Series:
    """Per request, in arrival order: arrival time, prompt tokens and, per target, tokens
    served from the cache; per target, seconds spent in its calls."""

    arrival_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    hit_tokens: dict[str, list[int]] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)


@dataclass(order=True)
class _Running:
    done_s: float
    seq: int
    tokens: np.ndarray = field(compare=False)
    envelopes: dict[str, torch.Tensor] = field(compare=False)
    lookups: list[Lookup] = field(compare=False)


class Replay:
    """Drives ``targets`` through requests given one at a time (:meth:`arrive`), then
    :meth:`finish` completes what is still running. ``layout`` is the (scaled) layout every
    target uses; the payloads and page keys are computed from it."""

    def __init__(self, targets: Sequence[ReplayTarget], layout: ModelLayout, *,
                 decode_s_per_token: float = 0.02, seed: int = 0,
                 hash_algorithm: str = "sha256") -> None:
        if decode_s_per_token < 0:
            raise ValueError(f"decode_s_per_token must be >= 0, got {decode_s_per_token}")
        self.targets = list(targets)
        self.layout = layout
        self.decode_s_per_token = decode_s_per_token
        self.seed = seed
        self.hasher = PageHasher(layout.name, layout.fingerprint, layout.page_size,
                                 hash_algorithm)  # type: ignore[arg-type]
        self.units = {k: e.nbytes for k, e in layout.envelopes().items()}
        self.series = Series(hit_tokens={t.name: [] for t in self.targets},
                             wall_s={t.name: 0.0 for t in self.targets})
        self._running: list[_Running] = []
        self._seq = 0

    def envelopes(self, tokens: np.ndarray) -> tuple[list[bytes], dict[str, torch.Tensor]]:
        """Page keys of the full pages of ``tokens`` and the envelopes a request stores for
        them: ``kv`` (and ``swa``) per page, ``state`` at the last page."""
        pages = len(tokens) // self.layout.page_size
        keys = self.hasher.pages(tokens[: pages * self.layout.page_size], NAMESPACE)
        out: dict[str, torch.Tensor] = {
            k: payload(keys, k, self.units[k]) for k in ("kv", "swa") if k in self.units}
        if "state" in self.units and keys:
            out["state"] = payload(keys[-1:], "state", self.units["state"])
        return keys, out

    def arrive(self, request: TraceRequest) -> None:
        """Complete what finished by ``request``'s arrival, then look ``request`` up in every
        target; it completes ``output_length * decode_s_per_token`` later."""
        self._complete_until(request.arrival_s)
        tokens = request_tokens(request, seed=self.seed)
        keys, envelopes = self.envelopes(tokens)
        lookups = []
        for target in self.targets:
            start = time.perf_counter()
            found = target.lookup(tokens, keys, envelopes)
            self.series.wall_s[target.name] += time.perf_counter() - start
            self.series.hit_tokens[target.name].append(found.tokens)
            lookups.append(found)
        self.series.arrival_s.append(request.arrival_s)
        self.series.prompt_tokens.append(request.input_length)
        done = request.arrival_s + request.output_length * self.decode_s_per_token
        self._seq += 1
        heapq.heappush(self._running, _Running(done, self._seq, tokens, envelopes, lookups))

    def finish(self) -> Series:
        """Complete every running request; the series so far."""
        self._complete_until(float("inf"))
        return self.series

    def _complete_until(self, now: float) -> None:
        while self._running and self._running[0].done_s <= now:
            run = heapq.heappop(self._running)
            for target, found in zip(self.targets, run.lookups, strict=True):
                start = time.perf_counter()
                target.complete(found, run.tokens, run.envelopes)
                self.series.wall_s[target.name] += time.perf_counter() - start

    def run(self, requests: Sequence[TraceRequest], *, progress: bool = True,
            speed: float | None = None) -> Series:
        """Replay ``requests`` in order (with a progress bar on stderr) and finish. With
        ``speed``, requests are paced in wall time: request i starts no earlier than its trace
        timestamp / ``speed`` after the first (a service-mode replay, time-compressed)."""
        begin = time.monotonic()
        with tqdm(total=len(requests), disable=not progress, unit="req",
                  desc="replay", dynamic_ncols=True) as bar:
            for i, request in enumerate(requests):
                if speed is not None:
                    wait = begin + request.arrival_s / speed - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                self.arrive(request)
                bar.update()
                if progress and (i % 50 == 0 or i == len(requests) - 1):
                    bar.set_postfix(self._rates(), refresh=False)
        return self.finish()

    def _rates(self) -> dict[str, str]:
        total = max(1, sum(self.series.prompt_tokens))
        return {name: f"{sum(hits) / total:.0%}"
                for name, hits in self.series.hit_tokens.items()}
