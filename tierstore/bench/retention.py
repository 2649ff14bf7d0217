"""Retention: the seed experiment, `unified` vs `per_kind` stopping rules.

Cache N distinct prefixes (KV pages + a state checkpoint each, SWA window pages when the layout
has them) in an arena sized to hold exactly them (plus --slack-mib), then run one unrelated long
request that allocates its KV at once (or in chunks), then re-request every prefix (prefix + a
short suffix). Reported per rule: prefixes retained, prompt tokens recomputed, and the repeated
requests' time under a cost model: uncached tokens cost 1/--prefill-tok-s seconds each, cached
tokens --reuse-us-per-token microseconds each. Runs on an accounting-only arena (real byte
sizes, no payload), so preset sizes fit on any machine.
"""

from __future__ import annotations

import argparse
import math

from tierstore.bench._util import fmt_ratio, ratio, table
from tierstore.config import StoreConfig
from tierstore.layout import ModelLayout, load_preset, preset_names
from tierstore.store import TierStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-next-80b-a3b", choices=preset_names())
    parser.add_argument("--prefixes", type=int, default=28)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--long-tokens", type=int, default=7000)
    parser.add_argument("--chunk-tokens", type=int, default=2048,
                        help="chunk size of the chunked variant")
    parser.add_argument("--suffix-tokens", type=int, default=64,
                        help="new tokens each repeated request adds after its prefix")
    parser.add_argument("--slack-mib", type=float, default=0.0,
                        help="free bytes in the arena beyond the cached prefixes")
    parser.add_argument("--capacity-mib", type=float, default=None,
                        help="arena size (overrides the prefixes + slack sizing)")
    parser.add_argument("--policy", default="lru", choices=["lru", "lfu", "priority"])
    parser.add_argument("--prefill-tok-s", type=float, default=10_000.0,
                        help="cost model: prefill throughput when recomputing")
    parser.add_argument("--reuse-us-per-token", type=float, default=0.0,
                        help="cost model: cost of a cached token (0: already in GPU memory)")


def _demand(layout: ModelLayout, tokens: int, with_state: bool) -> dict[str, int]:
    pages = math.ceil(tokens / layout.page_size)
    demand = {"kv": pages}
    if layout.swa is not None:
        demand["swa"] = min(pages, layout.swa_window_pages())
    if layout.state is not None and with_state:
        demand["state"] = 1
    return demand


def _bytes(layout: ModelLayout, demand: dict[str, int]) -> int:
    envelopes = layout.envelopes()
    return sum(envelopes[k].nbytes * n for k, n in demand.items())


def _prefix(i: int, n: int) -> list[int]:
    return [(i * 7919 + j * 31 + 1) % 150_000 for j in range(n)]


def fill_prefixes(store: TierStore, count: int, tokens: int) -> None:
    """Cache ``count`` distinct prefixes of ``tokens`` tokens, each with its KV pages, SWA
    window pages and a state checkpoint (as the layout has them), through allocate + insert."""
    layout = store.layout
    for i in range(count):
        alloc = store.allocate(_demand(layout, tokens, True))
        assert alloc is not None, "the arena cannot hold the prefixes: raise --capacity-mib"
        store.insert(_prefix(i, tokens), kv=alloc["kv"],
                     swa=alloc["swa"] if layout.swa is not None else None,
                     state=alloc["state"] if layout.state is not None else None)


def _scenario(args: argparse.Namespace, layout: ModelLayout, capacity: int, rule: str,
              chunk: int) -> dict[str, object]:
    store = TierStore(layout, StoreConfig(capacity_bytes=capacity, device="meta",
                                          stop_rule=rule, eviction=args.policy))  # type: ignore[arg-type]
    pages = args.prefix_tokens // layout.page_size
    fill_prefixes(store, args.prefixes, pages * layout.page_size)
    long_request = []
    done = 0
    while done < args.long_tokens:
        step = min(chunk, args.long_tokens - done)
        demand = _demand(layout, done + step, done == 0)
        demand["kv"] = math.ceil((done + step) / layout.page_size) - math.ceil(
            done / layout.page_size)
        if "swa" in demand:
            demand["swa"] = 0 if done else demand["swa"]
        alloc = store.allocate(demand)
        if alloc is None:
            raise SystemExit(f"{rule}: the long request does not fit; raise --capacity-mib")
        long_request.append(alloc)
        done += step
    evictions = store.stats().evictions
    cached = [store.peek(_prefix(i, pages * layout.page_size) + [0] * args.suffix_tokens)
              for i in range(args.prefixes)]
    retained = sum(1 for c in cached if c == pages * layout.page_size)
    prompt = pages * layout.page_size + args.suffix_tokens
    recomputed = sum(prompt - c for c in cached)
    reused = sum(cached)
    seconds = recomputed / args.prefill_tok_s + reused * args.reuse_us_per_token * 1e-6
    store.check_integrity()
    shape = "one" if chunk >= args.long_tokens else f"chunks of {chunk}"
    return {"rule": rule, "allocation": shape,
            "retained": retained, "evictions": evictions, "recomputed_tokens": recomputed,
            "repeat_seconds": seconds}


def run(args: argparse.Namespace) -> dict:
    layout = load_preset(args.model)
    pages = args.prefix_tokens // layout.page_size
    per_prefix = _bytes(layout, _demand(layout, pages * layout.page_size, True))
    capacity = (int(args.capacity_mib * 2**20) if args.capacity_mib is not None
                else args.prefixes * per_prefix + int(args.slack_mib * 2**20))
    capacity = -(-capacity // 256) * 256
    rows = [_scenario(args, layout, capacity, rule, chunk)
            for chunk in (args.long_tokens, args.chunk_tokens)
            for rule in ("unified", "per_kind")]
    one, chunked = rows[:2], rows[2:]

    def compare(pair: list[dict]) -> dict[str, float | None]:
        u, p = pair
        time_ratio = ratio(u["repeat_seconds"], p["repeat_seconds"])
        return {"retained_ratio": ratio(u["retained"], p["retained"]),
                "time_reduction": None if time_ratio is None else 1 - time_ratio}

    envelopes = {k: e.nbytes for k, e in layout.envelopes().items()}
    return {"model": args.model, "envelope_bytes": envelopes, "prefixes": args.prefixes,
            "prefix_tokens": pages * layout.page_size, "long_tokens": args.long_tokens,
            "capacity_mib": capacity / 2**20, "per_prefix_mib": per_prefix / 2**20,
            "rows": rows, "one_allocation": compare(one), "chunked": compare(chunked),
            "cost_model": {"prefill_tok_s": args.prefill_tok_s,
                           "reuse_us_per_token": args.reuse_us_per_token}}


def render(result: dict) -> str:
    one, chunked = result["one_allocation"], result["chunked"]
    return "\n".join([
        f"{result['model']}: {result['prefixes']} prefixes of {result['prefix_tokens']} tokens "
        f"({result['per_prefix_mib']:.1f} MiB each), arena {result['capacity_mib']:.1f} MiB, "
        f"long request {result['long_tokens']} tokens",
        table(result["rows"], ["allocation", "rule", "retained", "evictions",
                               "recomputed_tokens", "repeat_seconds"]),
        f"one allocation: unified retains {fmt_ratio(one['retained_ratio'])}x the prefixes, "
        f"repeated requests {fmt_ratio(one['time_reduction'], '.1%')} faster",
        f"chunked:        unified retains {fmt_ratio(chunked['retained_ratio'])}x the prefixes, "
        f"repeated requests {fmt_ratio(chunked['time_reduction'], '.1%')} faster",
    ])
