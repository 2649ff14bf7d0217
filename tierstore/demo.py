"""``tierstore demo``: what the unified arena and unified-aware eviction buy, in one minute."""

from __future__ import annotations

import argparse
import time

import torch

from tierstore.bench import arena as arena_bench
from tierstore.bench import retention as retention_bench
from tierstore.config import StoreConfig
from tierstore.store import TierStore
from tierstore.testing.reference_model import ReferenceModel, tiny_layout


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


def main() -> int:
    print("== tierstore demo ==\n")
    print(_reference_model(), "\n")
    args = _defaults(arena_bench)
    args.quick = True
    print(arena_bench.render({**arena_bench.run(args)}), "\n")
    print(retention_bench.render(retention_bench.run(_defaults(retention_bench))))
    print("\nMore: `tierstore bench arena|retention|kernels|redis --json`; docs/benchmarks.md.")
    return 0
