"""``tierstore demo``: the service on embedded defaults, a shared-prefix workload through the
HTTP client, per-tier hit rates; then what the unified arena and eviction rule buy."""

from __future__ import annotations

import argparse
import random
import time
from contextlib import ExitStack

import torch
from tqdm import tqdm

from tierstore.bench import arena as arena_bench
from tierstore.bench import retention as retention_bench
from tierstore.client import Client
from tierstore.config import StoreConfig
from tierstore.service.server import add_arguments as serve_arguments
from tierstore.service.server import build
from tierstore.store import TierStore
from tierstore.testing.reference_model import ReferenceModel, tiny_layout
from tierstore.testing.service import RunningService, free_port


def _defaults(module: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args([])


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


def _service_workload(stack: ExitStack) -> str:
    """Start the service (private redis-server if installed), replay a shared-prefix chat
    workload through the HTTP client, return the per-tier hit rates."""
    parser = argparse.ArgumentParser()
    serve_arguments(parser)
    # A small GPT-OSS-20B-shaped arena (KV + sliding window) so demotion shows in seconds.
    args = parser.parse_args(["--model", "gpt-oss-20b", "--page-size", "16", "--l1", "96MiB",
                              "--l2", "192MiB", "--port", str(free_port())])
    service, config = build(args, stack)
    running = stack.enter_context(RunningService(service.store, config,
                                                 service.kv_remote))
    layout = service.store.layout
    page = layout.page_size
    units = {k: e.nbytes for k, e in layout.envelopes().items()}
    rng = random.Random(0)
    systems = [[rng.randrange(200_000) for _ in range(512)] for _ in range(6)]
    client = stack.enter_context(Client(running.url))
    conversations = [list(systems[i % 6]) for i in range(40)]
    blob = {k: bytes(rng.randrange(256) for _ in range(64)) * (u // 64) for k, u in units.items()}
    for _ in tqdm(range(6), desc="turns", unit="turn"):
        for conv in conversations:
            conv += [rng.randrange(200_000) for _ in range(rng.randrange(32, 160))]
            client.match(conv[:-1])
            pages = len(conv) // page
            client.insert(conv[: pages * page], kv=[blob["kv"]] * pages,
                          swa=[blob["swa"]] * min(pages, layout.swa_window_pages()))
    stats = client.stats()
    queried = stats["tokens_queried"] or 1
    lines = [f"service on {running.url}: {stats['requests']} requests, token hit rate "
             f"{stats['hit_rate']:.1%}"]
    for tier, label in (("l1", "GPU arena"), ("l2", "host"), ("l3", "Redis")):
        lines.append(f"  {label:<10} {stats['hit_tokens'][tier] / queried:6.1%} of prompt tokens")
    moved = {k: v / 2**20 for k, v in stats["moved_bytes"].items() if v}
    lines.append(f"  moved MiB: {', '.join(f'{k} {v:.0f}' for k, v in moved.items()) or '-'}")
    lines.append(f"  L3 (Redis): {'on' if service.store.remote else 'off (no redis-server)'}")
    lines.append(f"dashboard: {running.url}/dashboard   metrics: {running.url}/metrics")
    return "\n".join(lines)


def main(offline: bool = False) -> int:
    print("== tierstore demo ==\n")
    if not offline:
        with ExitStack() as stack:
            print(_service_workload(stack), "\n")
    print(_reference_model(), "\n")
    args = _defaults(arena_bench)
    args.quick = True
    print(arena_bench.render(arena_bench.run(args)), "\n")
    print(retention_bench.render(retention_bench.run(_defaults(retention_bench))))
    print("\nMore: `tierstore serve`, `tierstore bench arena|retention|tiers|redis|kernels "
          "--json`; docs/benchmarks.md.")
    return 0
