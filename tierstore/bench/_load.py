"""Same-host storage reads and a concurrent load mix against ``tierstore serve`` run as its own
process (as engines use it), for ``bench http``.

The load mix: every client (a thread; clients spread over a few processes) inserts its own
4-page prefix, then repeats ``match`` (64 tokens), ``fetch`` (its 4 x 1 MiB envelopes),
``batch_set`` (4 values of 256 KiB), ``batch_get`` of them and ``batch_exists`` — fetches and
storage calls all over HTTP, or through the shared segment (control calls still HTTP).
Every fetched envelope and every value read is checked
against what was written (``wrong_bytes``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierstore.bench._util import ratio
from tierstore.client import Client
from tierstore.service.running import Served
from tierstore.service.running import serve_process as _serve_child
from tierstore.shm_client import SharedMemoryTransport, open_transport

PAGE = 16


@dataclass(frozen=True)
class LoadSpec:
    """The mix: ``clients`` threads over ``processes``, ``rounds`` iterations each."""

    clients: int = 16
    processes: int = 4
    rounds: int = 15
    value_bytes: int = 256 << 10
    values_per_set: int = 4
    fetch_pages: int = 4


@contextmanager
def serve_process(config: dict[str, Any], l1: str = "256MiB") -> Iterator[Served]:
    """``tierstore serve`` in a child process on a free loopback port (CPU, no L2/L3) with the
    layout ``config``; yields it and stops it (by its pid) on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        with _serve_child(["--model-config", path, "--page-size", str(PAGE), "--l1", l1,
                           "--l2", "0", "--no-redis", "--device", "cpu"]) as served:
            yield served


def store_busy_s(served: Served) -> float | None:
    """Seconds the service's store thread has spent in store calls (``/v1/stats``; None from a
    service that does not report it)."""
    with urllib.request.urlopen(served.url + "/v1/stats", timeout=30) as response:
        busy = json.loads(response.read())["service"].get("store_busy_s")
    return None if busy is None else float(busy)


# ------------------------------------------------------------------ same-host reads
def read_rates(url: str, pages: int, unit: int, repeat: int) -> dict[str, float]:
    """MB/s reading ``pages`` values of ``unit`` bytes into preallocated buffers through the
    shared segment and over HTTP, and of a plain torch ``copy_`` of the same bytes (best of
    ``repeat`` each, interleaved)."""
    keys = [f"read-{i}" for i in range(pages)]
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, unit, dtype=np.uint8).tobytes() for _ in range(pages)]
    sources = [torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in values]
    targets = [torch.empty(unit, dtype=torch.uint8) for _ in range(pages)]
    with Client(url, retries=0) as client:
        transport = SharedMemoryTransport.attach(client)
        assert all(transport.batch_set(keys, values)), "the shared segment took no values"

        def take(i: int, view: torch.Tensor) -> bool:
            targets[i].copy_(view)  # the baseline's own copy: the ratio is the transport's cost
            return True

        best = {"shm": float("inf"), "http": float("inf"), "copy": float("inf")}
        for _ in range(repeat):
            start = time.perf_counter()
            assert all(transport.get_into(keys, "default", take))
            best["shm"] = min(best["shm"], time.perf_counter() - start)
            start = time.perf_counter()
            got = client.batch_get(keys)
            best["http"] = min(best["http"], time.perf_counter() - start)
            start = time.perf_counter()
            for dst, src in zip(targets, sources, strict=True):
                dst.copy_(src)
            best["copy"] = min(best["copy"], time.perf_counter() - start)
        assert got == values and all(torch.equal(t, s) for t, s in zip(targets, sources,
                                                                         strict=True))
        transport.close()
    return {name: pages * unit / s / 1e6 for name, s in best.items()}


# ------------------------------------------------------------------ the load mix
def run_mix(served: Served, transport: str, spec: LoadSpec, unit: int) -> dict[str, Any]:
    """Requests/s, p50/p99 (ms), the service's CPU per request and wrong bytes of the mix,
    clients in child processes."""
    url = served.url
    ctx = mp.get_context("spawn")
    per = [spec.clients // spec.processes + (i < spec.clients % spec.processes)
           for i in range(spec.processes)]
    barrier = ctx.Barrier(spec.clients + 1)
    results = ctx.Queue()
    procs, first = [], 0
    for n in per:
        procs.append(ctx.Process(target=_client_process, daemon=True, args=(
            url, transport, first, n, spec, unit, barrier, results)))
        first += n
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=300)  # every client has inserted its prefix and attached
        start, cpu, busy = time.perf_counter(), served.cpu_s(), store_busy_s(served)
        got = [results.get(timeout=600) for _ in range(spec.processes)]
        elapsed, cpu = time.perf_counter() - start, served.cpu_s() - cpu
        end_busy = store_busy_s(served)
        busy_share = None if busy is None or end_busy is None else (end_busy - busy) / elapsed
    finally:
        for p in procs:
            p.join(timeout=60)
    latencies = sorted(x for g in got for x in g["latencies"])
    return {"clients": spec.clients, "requests": len(latencies),
            "requests_s": len(latencies) / elapsed,
            "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
            "wrong_bytes": sum(g["wrong"] for g in got),
            "service_cpu_ms": ratio(cpu * 1e3, len(latencies)),
            "service_cores": cpu / elapsed,
            "store_thread_busy": busy_share,
            "shm_clients": sum(g["shm"] for g in got)}


def _client_process(url: str, transport: str, first: int, count: int, spec: LoadSpec,
                    unit: int, barrier: Any, results: Any) -> None:
    torch.set_num_threads(1)
    out: list[dict[str, Any]] = [{} for _ in range(count)]
    threads = [threading.Thread(target=_client, args=(url, transport, first + i, spec, unit,
                                                     barrier, out[i])) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put({"latencies": [x for o in out for x in o.get("latencies", [])],
                 "wrong": sum(o.get("wrong", 0) for o in out),
                 "shm": sum(o.get("shm", 0) for o in out)})


def _client(url: str, transport: str, cid: int, spec: LoadSpec, unit: int, barrier: Any,
            out: dict[str, Any]) -> None:
    latencies: list[float] = []
    wrong = 0
    with Client(url, retries=3) as client:
        shm = open_transport(client, "shm" if transport == "shm" else "http")
        tokens = list(range(cid * 100_000, cid * 100_000 + spec.fetch_pages * PAGE))
        envelopes = [_filled(unit, cid, page) for page in range(spec.fetch_pages)]
        client.insert(tokens, kv=envelopes, namespace=f"c{cid}")
        barrier.wait(timeout=300)
        filler = [bytearray(_filled(spec.value_bytes, cid, i)) for i in
                  range(spec.values_per_set)]
        for r in range(spec.rounds):
            keys = [f"c{cid}-r{r}-{i}" for i in range(spec.values_per_set)]
            for i, value in enumerate(filler):  # the head names the key: a swap shows
                value[:32] = keys[i].encode().ljust(32, b"\0")
            values = [bytes(v) for v in filler]
            start = time.perf_counter()
            client.match(tokens[:64], namespace=f"c{cid}")
            latencies.append(time.perf_counter() - start)
            start = time.perf_counter()
            got = shm.fetch([*tokens, 0], f"c{cid}") if shm is not None else \
                client.fetch([*tokens, 0], namespace=f"c{cid}")
            latencies.append(time.perf_counter() - start)
            wrong += sum(a != b for a, b in zip(got["kv"], envelopes, strict=False))
            wrong += abs(len(got["kv"]) - len(envelopes))
            start = time.perf_counter()
            if shm is not None:
                shm.batch_set(keys, values)
            else:
                client.batch_set(keys, values)
            latencies.append(time.perf_counter() - start)
            start = time.perf_counter()
            read = shm.batch_get(keys) if shm is not None else client.batch_get(keys)
            latencies.append(time.perf_counter() - start)
            wrong += sum(a != b for a, b in zip(read, values, strict=True))
            start = time.perf_counter()
            client.batch_exists(keys)
            latencies.append(time.perf_counter() - start)
        if shm is not None:
            shm.close()
    out.update(latencies=latencies, wrong=wrong, shm=int(shm is not None))


def _filled(nbytes: int, cid: int, n: int) -> bytes:
    """Bytes that name their owner and index (a value served under another key shows)."""
    head = f"{cid}/{n}/".encode()
    return head + bytes([(cid * 31 + n * 7) % 251]) * (nbytes - len(head))
