"""Soak: N concurrent clients for T seconds against a real ``tierstore serve`` (subprocess,
with a token and its own Redis), mixing match / insert / fetch / release and the storage API
with payloads whose bytes are checked on every read; optional chaos (Redis SIGKILLed and
restarted empty, the service SIGKILLed and restarted) and connection abuse (idle sockets and
slowloris). Reports requests/s, p50/p99 per endpoint, errors by kind, wrong bytes (must be
0), 5xx answers and the service's RSS growth.

``--tenants N`` runs the service with a generated principals file of N tenants (own tokens);
client ``i`` is tenant ``i % N`` and uses namespace ``soak-w{i // N}`` with the same keys and
token ids as the clients of the other tenants, but payloads of its own. A read returning the
payload another tenant wrote under the same names counts as cross-tenant bytes (must be 0).

The load is this module's own asyncio loop over ``AsyncClient`` rather than a load library
(locust): checking every byte needs the client's msgpack decoding and the generator's state
(what was written where), chaos and abuse run beside the clients in the same loop, and
locust's gevent patching would fight both. One process drives every client, so on a small
machine the figures are bounded by this process too (the service is a separate process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from remote_tier.embedded import RedisServer, free_port
from tierstore.bench._util import table
from tierstore.client import AsyncClient, ServiceError
from tierstore.reference_model import CONFIG
from tierstore.service.principals import hash_token, new_token

TOKEN = "soak-token"
PAGE = 16
MIX = {"insert": 15, "match": 10, "match_lock": 5, "fetch": 20, "batch_set": 15,
       "batch_get": 20, "batch_exists": 10, "delete": 5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-redis-at", type=float, default=None,
                        help="SIGKILL Redis this many seconds in, restart it (empty) "
                             "--redis-down seconds later")
    parser.add_argument("--redis-down", type=float, default=3.0)
    parser.add_argument("--kill-service-at", type=float, default=None,
                        help="SIGKILL the service this many seconds in and restart it")
    parser.add_argument("--abuse", type=int, default=0,
                        help="idle sockets to hold open (reopened when closed), plus one "
                             "slowloris connection a second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tenants", type=int, default=0,
                        help="run as this many tenants (a principals file, a token each), "
                             "all naming the same namespaces, keys and prompts; counts "
                             "cross-tenant bytes (0: one token, today's mode)")


def _expected(*parts: object, size: int) -> bytes:
    """The deterministic payload for ``parts`` (what a read must return byte for byte)."""
    seed = int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")
    return np.random.default_rng(seed).bytes(size)


@dataclass
class Tally:
    """What the clients saw: latencies per endpoint, errors by kind, verification counts."""

    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    verified: Counter[str] = field(default_factory=Counter)
    wrong_values: int = 0
    wrong_bytes: int = 0
    cross_tenant_values: int = 0
    cross_tenant_bytes: int = 0
    http_5xx: int = 0

    def check(self, what: str, got: bytes | None, want: bytes,
              others: Callable[[], list[bytes]] = list) -> None:
        """Count ``got`` (a read, None for a miss) against ``want``; ``others`` gives what
        the other tenants wrote under the same names (a match is cross-tenant bytes)."""
        if got is None:
            self.verified[f"{what}_miss"] += 1
            return
        self.verified[what] += 1
        if got != want and got in others():
            self.cross_tenant_values += 1
            self.cross_tenant_bytes += len(got)
        if got != want:
            self.wrong_values += 1
            n = min(len(got), len(want))
            diff = np.frombuffer(got[:n], np.uint8) != np.frombuffer(want[:n], np.uint8)
            self.wrong_bytes += int(np.count_nonzero(diff)) + abs(len(got) - len(want))


class Worker:
    """One client: its own namespace (of its tenant), connection pool and record of what it
    wrote."""

    def __init__(self, wid: int, url: str, units: dict[str, int], tally: Tally,
                 rng: random.Random, *, tenants: int = 0, token: str = TOKEN) -> None:
        self.wid, self.url, self.units, self.tally, self.rng = wid, url, units, tally, rng
        self.token = token
        self.tenants = max(1, tenants)
        # With tenants, clients of different tenants share namespace names (and keys and
        # token ids): only the tenant tells their data apart.
        self.slot, self.tenant = divmod(wid, self.tenants) if tenants else (wid, 0)
        self.ns = f"soak-w{self.slot}"
        self.prompts: list[int] = []  # sequence numbers of inserted prompts
        self.keys: list[str] = []
        self.seq = 0

    def tokens(self, seq: int) -> list[int]:
        pages = 1 + seq % 4
        base = (self.slot * 1_000_003 + seq) * 64
        return list(range(base, base + pages * PAGE))

    def value(self, key: str, tenant: int | None = None) -> bytes:
        size = 64 + int.from_bytes(hashlib.blake2b(key.encode(), digest_size=2).digest(),
                                   "big") % 40_000
        return _expected(self._label(tenant), key, size=size)

    def envelope(self, seq: int, kind: str, page: int, tenant: int | None = None) -> bytes:
        return _expected(self._label(tenant), seq, kind, page, size=self.units[kind])

    def _label(self, tenant: int | None) -> str:
        tenant = self.tenant if tenant is None else tenant
        return self.ns if self.tenants == 1 else f"t{tenant}/{self.ns}"

    def _others(self, make: Callable[[int], bytes]) -> Callable[[], list[bytes]]:
        """What the other tenants' clients write under the same names (computed lazily)."""
        return lambda: [make(t) for t in range(self.tenants) if t != self.tenant]

    async def run(self, deadline: float) -> None:
        ops = list(MIX)
        weights = [MIX[o] for o in ops]
        async with AsyncClient(self.url, token=self.token, retries=0, timeout_s=30) as client:
            while time.monotonic() < deadline:
                op = self.rng.choices(ops, weights)[0]
                start = time.perf_counter()
                try:
                    await getattr(self, f"_{op}")(client)
                except ServiceError as exc:
                    self.tally.errors[f"{exc.status} {exc.error}"] += 1
                    self.tally.http_5xx += exc.status >= 500
                except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                    self.tally.errors[type(exc).__name__] += 1
                    await asyncio.sleep(0.05)  # the service may be restarting
                else:
                    self.tally.latency[op].append(time.perf_counter() - start)

    async def _insert(self, client: AsyncClient) -> None:
        seq, self.seq = self.seq, self.seq + 1
        pages = len(self.tokens(seq)) // PAGE
        await client.insert(self.tokens(seq), self.ns,
                            kv=[self.envelope(seq, "kv", p) for p in range(pages)],
                            swa=[self.envelope(seq, "swa", p) for p in range(pages)],
                            state=self.envelope(seq, "state", pages))
        self.prompts.append(seq)

    async def _match(self, client: AsyncClient) -> None:
        if self.prompts:
            await client.match(self.tokens(self.rng.choice(self.prompts)) + [1], self.ns)

    async def _match_lock(self, client: AsyncClient) -> None:
        if self.prompts:
            m = await client.match(self.tokens(self.rng.choice(self.prompts)) + [1], self.ns,
                                   lock=True)
            if m["lease"] is not None:
                await client.release(m["lease"])

    async def _fetch(self, client: AsyncClient) -> None:
        if not self.prompts:
            return
        seq = self.rng.choice(self.prompts)
        got = await client.fetch(self.tokens(seq) + [1], self.ns)
        for p, blob in enumerate(got["kv"]):
            self.tally.check("kv_pages", blob, self.envelope(seq, "kv", p), self._others(
                functools.partial(self.envelope, seq, "kv", p)))
        for p, blob in enumerate(got["swa"]):
            if blob is not None:
                self.tally.check("swa_pages", blob, self.envelope(seq, "swa", p),
                                 self._others(functools.partial(self.envelope, seq, "swa", p)))
        if got["state"] is not None:
            pages = got["pages"]
            self.tally.check("states", got["state"], self.envelope(seq, "state", pages),
                             self._others(functools.partial(self.envelope, seq, "state", pages)))

    async def _batch_set(self, client: AsyncClient) -> None:
        keys = [f"k{self.seq}-{i}" for i in range(self.rng.randint(1, 8))]
        self.seq += 1
        await client.batch_set(keys, [self.value(k) for k in keys], self.ns)
        self.keys += keys

    async def _batch_get(self, client: AsyncClient) -> None:
        if self.keys:
            keys = self.rng.sample(self.keys, min(8, len(self.keys)))
            for key, got in zip(keys, await client.batch_get(keys, self.ns), strict=True):
                self.tally.check("values", got, self.value(key),
                                 self._others(functools.partial(self.value, key)))

    async def _batch_exists(self, client: AsyncClient) -> None:
        if self.keys:
            await client.batch_exists(self.rng.sample(self.keys, min(8, len(self.keys))),
                                      self.ns)

    async def _delete(self, client: AsyncClient) -> None:
        if self.keys:
            key = self.keys.pop(self.rng.randrange(len(self.keys)))
            await client.delete([key], self.ns)


class ServiceProcess:
    """``tierstore serve`` as a child process (so it can be SIGKILLed and its RSS read)."""

    def __init__(self, redis_url: str, workdir: str, principals: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = os.path.join(workdir, "config.json")
        with open(config, "w") as f:
            json.dump(CONFIG, f)
        self._args = [sys.executable, "-m", "tierstore.cli", "serve", "--port", str(self.port),
                      "--model-config", config, "--page-size", str(PAGE), "--device", "cpu",
                      "--l1", "8MiB", "--l2", "16MiB", "--redis-url", redis_url,
                      "--lease-ttl", "10"]
        self._args += ["--principals", principals] if principals else ["--auth-token", TOKEN]
        self._log = os.path.join(workdir, "service.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self, timeout_s: float = 120.0) -> None:
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        with open(self._log, "rb") as log:
            tail = log.read()[-3000:].decode(errors="replace")
        raise RuntimeError(f"the service did not come up in {timeout_s} s; its log ends:\n{tail}")

    def kill(self) -> None:
        """SIGKILL the service, then remove the shared-memory segments it had mapped (a
        killed service cannot unlink them, and each holds its host copy's memory)."""
        if self.proc is not None and self.proc.poll() is None:
            segments = self._shm_segments()
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            for path in segments:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _shm_segments(self) -> set[str]:
        assert self.proc is not None
        try:
            with open(f"/proc/{self.proc.pid}/maps") as f:
                return {line.split(None, 5)[5].strip() for line in f
                        if " /dev/shm/tierstore-" in line}
        except OSError:
            return set()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def rss_bytes(self) -> int:
        """The service's resident set size now (0 when not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0


async def _at(delay: float, action: Callable[[], Awaitable[None]]) -> None:
    await asyncio.sleep(delay)
    await action()


async def _abuse(port: int, num_idle: int, deadline: float, counts: Counter[str]) -> None:
    """Hold ``num_idle`` idle sockets (reopened as the service closes them) and open one
    slowloris connection a second; count what the service closed."""
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    slow: list[asyncio.StreamWriter] = []
    watchers: list[asyncio.Future[None]] = []
    try:
        while time.monotonic() < deadline:
            idle = [(r, w) for r, w in idle if not r.at_eof()]
            while len(idle) < num_idle:
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    counts["connect_failed"] += 1
                    break
                idle.append((reader, writer))
                counts["idle_opened"] += 1
                watchers.append(asyncio.ensure_future(
                    _watch(reader, counts, "idle_closed_by_service")))
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/match HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                slow.append(writer)
                counts["slowloris_opened"] += 1
                watchers.append(asyncio.ensure_future(
                    _watch(reader, counts, "slowloris_closed_by_service")))
            except OSError:
                counts["connect_failed"] += 1
            await asyncio.sleep(1.0)
    finally:
        for w in [w for _, w in idle] + slow:
            w.close()
        for watcher in watchers:
            watcher.cancel()


async def _watch(reader: asyncio.StreamReader, counts: Counter[str], what: str) -> None:
    try:
        while await reader.read(4096):
            pass
        counts[what] += 1
    except (OSError, asyncio.CancelledError):
        pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; the figures."""
    with tempfile.TemporaryDirectory(prefix="tierstore-soak-") as workdir, \
            RedisServer() as redis:
        tokens = [new_token() for _ in range(args.tenants)]
        principals = None
        if tokens:
            principals = os.path.join(workdir, "principals.json")
            with open(principals, "w") as f:
                json.dump({"tenants": {f"t{i}": {"tokens": [hash_token(token)],
                                                 "namespaces": ["soak-*"]}
                                       for i, token in enumerate(tokens)}}, f)
        service = ServiceProcess(redis.url, workdir, principals)
        service.start()
        try:
            return asyncio.run(_soak(args, redis, service, tokens))
        finally:
            service.stop()


async def _soak(args: argparse.Namespace, redis: RedisServer, service: ServiceProcess,
                tokens: list[str]) -> dict[str, Any]:
    from tierstore.reference_model import tiny_layout

    units = {k: e.nbytes for k, e in tiny_layout(PAGE).envelopes().items()}
    tally, abuse = Tally(), Counter[str]()
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    events: list[str] = []
    start = time.monotonic()
    deadline = start + args.seconds

    async def kill_redis() -> None:
        redis.kill()
        events.append(f"{time.monotonic() - start:.1f}s redis SIGKILLed")
        await asyncio.sleep(args.redis_down)
        await loop.run_in_executor(None, redis.start)
        events.append(f"{time.monotonic() - start:.1f}s redis restarted (empty)")

    async def kill_service() -> None:
        service.kill()
        events.append(f"{time.monotonic() - start:.1f}s service SIGKILLed")
        await loop.run_in_executor(None, service.start)
        service.restarts += 1
        events.append(f"{time.monotonic() - start:.1f}s service restarted")

    rss_start = service.rss_bytes()
    tasks = [asyncio.ensure_future(Worker(
        i, service.url, units, tally, random.Random(rng.random()), tenants=len(tokens),
        token=tokens[i % len(tokens)] if tokens else TOKEN).run(deadline))
        for i in range(args.clients)]
    side = []
    if args.kill_redis_at is not None:
        side.append(asyncio.ensure_future(_at(args.kill_redis_at, kill_redis)))
    if args.kill_service_at is not None:
        side.append(asyncio.ensure_future(_at(args.kill_service_at, kill_service)))
    if args.abuse:
        side.append(asyncio.ensure_future(_abuse(service.port, args.abuse, deadline, abuse)))
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - start
    for task in side:
        await task
    rss_end = service.rss_bytes()
    total = sum(len(v) for v in tally.latency.values())
    endpoints = {op: {"requests": len(v), "p50_ms": 1000 * float(np.percentile(v, 50)),
                      "p99_ms": 1000 * float(np.percentile(v, 99))}
                 for op, v in sorted(tally.latency.items()) if v}
    return {"clients": args.clients, "seconds": round(elapsed, 1), "ok_requests": total,
            "requests_per_s": total / elapsed, "endpoints": endpoints,
            "errors": dict(tally.errors), "http_5xx": tally.http_5xx,
            "wrong_values": tally.wrong_values, "wrong_bytes": tally.wrong_bytes,
            "tenants": len(tokens), "cross_tenant_values": tally.cross_tenant_values,
            "cross_tenant_bytes": tally.cross_tenant_bytes,
            "verified": dict(tally.verified), "events": events, "abuse": dict(abuse),
            "service_restarts": service.restarts, "rss_start_mib": rss_start / 2**20,
            "rss_end_mib": rss_end / 2**20, "rss_growth_mib": (rss_end - rss_start) / 2**20,
            "cpus": os.cpu_count()}


def render(result: dict[str, Any]) -> str:
    rows = [{"endpoint": op, **v} for op, v in result["endpoints"].items()]
    lines = [table(rows, ["endpoint", "requests", "p50_ms", "p99_ms"]),
             f"{result['clients']} clients, {result['seconds']} s: "
             f"{result['requests_per_s']:.0f} ok requests/s; 5xx {result['http_5xx']}; "
             f"wrong values {result['wrong_values']}, wrong bytes {result['wrong_bytes']}"
             + (f"; {result['tenants']} tenants, cross-tenant values "
                f"{result['cross_tenant_values']}, bytes {result['cross_tenant_bytes']}"
                if result.get("tenants") else ""),
             f"verified reads: {result['verified']}",
             f"errors: {result['errors'] or 'none'}",
             f"service RSS {result['rss_start_mib']:.0f} -> {result['rss_end_mib']:.0f} MiB "
             f"({result['rss_growth_mib']:+.0f}); restarts {result['service_restarts']}"]
    if result["events"]:
        lines.append("events: " + "; ".join(result["events"]))
    if result["abuse"]:
        lines.append(f"abuse: {result['abuse']}")
    return "\n".join(lines)
