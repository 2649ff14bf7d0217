"""HTTP: /v1/fetch throughput of 1 MiB envelopes vs a bare aiohttp server answering the same
bytes, and small /v1/match requests per second; same-host storage reads through the shared
segment vs a plain torch copy; a concurrent load mix over HTTP and with shared memory.

The fetch servers run in this process on loopback (each on its own event-loop thread) and are
read by the same aiohttp client code, so the ratio isolates what the service adds: matching,
copying the envelopes out of the arena on the store thread, and packing them. The shared-memory
rows and the load mix run ``tierstore serve`` as its own process (see ``_load``).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import msgpack
from aiohttp import web

from tierstore.bench._load import LoadSpec, read_rates, run_mix, serve_process
from tierstore.bench._util import fmt_ratio, ratio, table
from tierstore.client import AsyncClient
from tierstore.config import StoreConfig
from tierstore.layout import layout_from_config
from tierstore.service.running import RunningService, free_port
from tierstore.store import TierStore

PAGE = 16
# One full-attention layer, 8 KV heads of 2048 dims in bf16, 16-token pages: 1 MiB envelopes.
CONFIG = {"name": "bench-1mib", "layer_types": ["full_attention"], "num_key_value_heads": 8,
          "head_dim": 2048, "torch_dtype": "bfloat16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=int, default=32, help="1 MiB envelopes per fetch")
    parser.add_argument("--fetches", type=int, default=40)
    parser.add_argument("--matches", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8, help="clients in flight")
    parser.add_argument("--clients", type=int, default=16, help="clients of the load mix")
    parser.add_argument("--rounds", type=int, default=15, help="load-mix iterations per client")
    parser.add_argument("--repeat", type=int, default=10, help="same-host reads (best of)")


class _Echo:
    """A bare aiohttp server that answers every POST with the same pre-packed body."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=self.body, content_type="application/msgpack")

    def __enter__(self) -> _Echo:
        self._thread.start()

        async def up() -> web.AppRunner:
            app = web.Application()
            app.router.add_post("/v1/fetch", self._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            return runner

        self._runner = asyncio.run_coroutine_threadsafe(up(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def _fetch_rate(url: str, tokens: list[int], fetches: int, concurrency: int
                      ) -> tuple[float, int]:
    async with AsyncClient(url, retries=0) as client:
        got = await client.fetch(tokens)  # warm
        size = sum(len(b) for b in got["kv"])
        queue = list(range(fetches))

        async def worker() -> None:
            while queue:
                queue.pop()
                reply = await client.fetch(tokens)
                assert len(reply["kv"]) == len(got["kv"])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return fetches * size / (time.perf_counter() - start), size


async def _match_rate(url: str, tokens: list[int], matches: int, concurrency: int) -> float:
    async with AsyncClient(url, retries=0) as client:
        queue = list(range(matches))

        async def worker() -> None:
            while queue:
                queue.pop()
                await client.match(tokens)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return matches / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict:
    layout = layout_from_config(CONFIG, page_size=PAGE)
    unit = layout.envelopes()["kv"].nbytes
    store = TierStore(layout, StoreConfig(capacity_bytes=(args.pages + 8) * unit))
    tokens = list(range(args.pages * PAGE))
    envelope = bytes(range(256)) * (unit // 256)
    with RunningService(store) as svc:

        async def load() -> None:
            async with AsyncClient(svc.url) as c:
                await c.insert(tokens, kv=[envelope] * args.pages)

        asyncio.run(load())
        query = [*tokens, 0]
        fetch_bps, size = asyncio.run(_fetch_rate(svc.url, query, args.fetches,
                                                  min(args.concurrency, 2)))
        small = list(range(64))
        match_rps = asyncio.run(_match_rate(svc.url, small, args.matches, args.concurrency))
    echo_body = msgpack.packb({"matched_tokens": len(tokens), "pages": args.pages,
                               "checkpoint": None, "tiers": {"l1": len(tokens)},
                               "kv": [envelope] * args.pages, "swa": [], "state": None},
                              use_bin_type=True)
    with _Echo(echo_body) as echo:
        echo_bps, _ = asyncio.run(_fetch_rate(f"http://127.0.0.1:{echo.port}", query,
                                              args.fetches, min(args.concurrency, 2)))
    spec = LoadSpec(clients=args.clients, processes=min(4, args.clients), rounds=args.rounds)
    with serve_process(CONFIG) as served:
        reads = read_rates(served.url, args.pages, unit, args.repeat)
        mix = {transport: run_mix(served, transport, spec, unit)
               for transport in ("http", "shm")}
    return {"envelope_bytes": unit, "pages_per_fetch": args.pages,
            "fetch_mb_s": fetch_bps / 1e6, "echo_mb_s": echo_bps / 1e6,
            "fetch_vs_echo": ratio(fetch_bps, echo_bps), "match_rps": match_rps,
            "match_concurrency": args.concurrency, "fetch_payload_mib": size / 2**20,
            "shm_get_mb_s": reads["shm"], "http_get_mb_s": reads["http"],
            "torch_copy_mb_s": reads["copy"], "shm_vs_copy": ratio(reads["shm"], reads["copy"]),
            "mix": mix,
            "mix_shm_vs_http": ratio(mix["shm"]["requests_s"], mix["http"]["requests_s"]),
            "mix_cpu_http_vs_shm": ratio(mix["http"]["service_cpu_ms"],
                                         mix["shm"]["service_cpu_ms"])}


def render(result: dict) -> str:
    rows = [{"what": "service /v1/fetch", "mb_s": result["fetch_mb_s"]},
            {"what": "bare aiohttp, same bytes", "mb_s": result["echo_mb_s"]}]
    return "\n".join([
        f"fetch of {result['pages_per_fetch']} x {result['envelope_bytes'] // 2**20} MiB "
        f"envelopes per request:",
        table(rows, ["what", "mb_s"]),
        f"service / bare = {fmt_ratio(result['fetch_vs_echo'])}",
        f"small /v1/match (64 tokens, {result['match_concurrency']} in flight): "
        f"{result['match_rps']:,.0f} requests/s",
        f"same-host storage reads of {result['pages_per_fetch']} x 1 MiB values "
        f"(`tierstore serve` in its own process):",
        table([{"what": "shared segment (shm_get + copy)", "mb_s": result["shm_get_mb_s"]},
               {"what": "HTTP batch_get", "mb_s": result["http_get_mb_s"]},
               {"what": "torch copy_ of the same bytes", "mb_s": result["torch_copy_mb_s"]}],
              ["what", "mb_s"]),
        f"shm / torch copy = {fmt_ratio(result['shm_vs_copy'])}",
        f"load mix ({result['mix']['http']['clients']} clients: match, fetch 4 x 1 MiB, "
        f"set/get 4 x 256 KiB, exists):",
        table([{"bytes via": k, **v} for k, v in result["mix"].items()],
              ["bytes via", "requests_s", "p50_ms", "p99_ms", "service_cpu_ms",
               "service_cores", "store_thread_busy", "wrong_bytes"]),
        f"shm / http: requests/s {fmt_ratio(result['mix_shm_vs_http'])}x, service CPU per "
        f"request {fmt_ratio(result['mix_cpu_http_vs_shm'])}x less",
    ])
