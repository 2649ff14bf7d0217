"""Replay: a Mooncake request trace against tierstore and the baselines users have today.

Every trace hash id becomes a deterministic 512-token block; each request looks its prompt up
on arrival and inserts it (full pages, plus a recurrent-state checkpoint at the last full page
for hybrid layouts) when it completes, ``output_length * --decode-ms-per-token`` later.
Configurations (``--configs``, default all): (a) GPU-only LRU radix cache, no tiers; (b) the
same GPU bytes in fixed per-kind pools; (c) the per_kind stopping rule; (d) tierstore with a
host tier (L2); (e) tierstore with L2 + Redis (L3, a private redis-server); (f) the infinite
cache. Capacities are bytes or fractions of the trace's working set; the run is at scale
(real-size accounting, small payloads verified on every hit). Reported per configuration:
prompt-token hit rate by tier, requests with any hit, bytes moved per tier pair, evictions,
and prefill seconds saved under the cost model (``--prefill-tok-s``, ``--host-gbps``,
``--redis-gbps``; see ``tierstore.replay.report`` for where the defaults come from).
``--disk`` adds the disk tier's configuration on the same trace: L1 5% + L2 5% + disk 30%
against L1 5% + L2 35% (``--disk-sizes``), side by side, with hits and bytes moved per tier and
the disk's own I/O time (:mod:`tierstore.bench._disk_replay`; ``bench disk --replay`` runs the
same code on the generated trace).
Service mode (``--url``): the same replay through the HTTP client against a running
``tierstore serve --model M --page-size P --scale N`` (the replay's scaled layout; give the same
``--scale N``), time-compressed with ``--speed``; latency percentiles of match / fetch / insert
are reported next to the hit rates. The service's own capacities apply (``--l1/--l2/--l3`` do
not).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierstore.bench import _disk_replay
from tierstore.bench._util import table
from tierstore.layout import preset_names
from tierstore.replay import mrc_check
from tierstore.replay.download import TraceDownloadError, fetch_trace, trace_name
from tierstore.replay.experiment import Setup, Size
from tierstore.replay.experiment import run as run_experiment
from tierstore.replay.report import CostModel
from tierstore.replay.synth import SynthSpec, synthesize, to_jsonl
from tierstore.replay.trace import TraceError, load_trace
from tierstore.scaling import parse_scale


def _split(text: str) -> dict[str, float] | None:
    if text == "auto":
        return None
    try:
        pairs = [part.split("=", 1) for part in text.split(",")]
        return {k.strip(): float(v) for k, v in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--split must be 'auto' or KIND=SHARE[,KIND=SHARE], got {text!r}") from None


def _scale(text: str) -> float | None:
    try:
        return parse_scale(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _disk_sizes(text: str) -> tuple[float, float, float, float]:
    try:
        return _disk_replay.parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> Size:
    try:
        return Size.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=None,
                        help="Mooncake-format JSONL trace: a path, or mooncake:conversation, "
                             "mooncake:toolagent, mooncake:synthetic (the public FAST'25 "
                             "traces, downloaded once into ~/.cache/tierstore/traces); default: "
                             "a generated trace (`tierstore trace synth` with its defaults)")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--model", default="qwen3-next-80b-a3b", choices=preset_names())
    parser.add_argument("--page-size", type=int, default=512,
                        help="tokens per page (512: one page per trace block)")
    parser.add_argument("--l1", type=_size, default=Size(fraction=0.05),
                        help="GPU arena: bytes (40GiB) or %% of the working set (default 5%%)")
    parser.add_argument("--l2", type=_size, default=Size(fraction=0.20),
                        help="host tier (default 20%%)")
    parser.add_argument("--l3", type=_size, default=Size(fraction=1.0),
                        help="Redis (default 100%%; >= 100%% is unbounded)")
    parser.add_argument("--configs", default="abcdef",
                        help="configurations to run, letters a-f (default all)")
    parser.add_argument("--split", type=_split, default=None,
                        help="fixed split (b): 'auto' (working-set shares of the first "
                             "--split-warmup of requests) or e.g. kv=0.8")
    parser.add_argument("--split-warmup", type=float, default=0.1)
    parser.add_argument("--scale", type=_scale, default=None,
                        help="scale factor: 'auto' (2^-k fitting --scaled-mib) or e.g. 1/2048")
    parser.add_argument("--scaled-mib", type=float, default=512.0,
                        help="auto scale: the working set's size once scaled")
    parser.add_argument("--decode-ms-per-token", type=float, default=20.0,
                        help="time model: a request completes output_length x this after "
                             "arrival (0: before the next arrival)")
    parser.add_argument("--seed", type=int, default=0, help="token-block seed")
    parser.add_argument("--prefill-tok-s", type=float, default=CostModel.prefill_tok_s,
                        help="cost model: recompute throughput (an assumption)")
    parser.add_argument("--host-gbps", type=float, default=CostModel.host_gbps,
                        help="cost model: host->GPU fetch GB/s (bench tiers, 4 MiB)")
    parser.add_argument("--redis-gbps", type=float, default=CostModel.redis_gbps,
                        help="cost model: Redis->GPU fetch GB/s (bench redis, 4 MiB get)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write an HTML plot of hit rate over trace time here")
    parser.add_argument("--window-s", type=float, default=60.0, help="plot window")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip reading back and checking every hit's envelopes")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--url", default=None,
                        help="service mode: replay against a running `tierstore serve`")
    parser.add_argument("--auth-token", default=None, help="service mode: bearer token")
    parser.add_argument("--speed", type=float, default=None,
                        help="service mode: pace requests at trace time / SPEED (e.g. 10)")
    parser.add_argument("--disk", action="store_true",
                        help="also replay the disk configuration: L1 5%% + L2 5%% + disk 30%% "
                             "vs L1 5%% + L2 35%% (two more stores, side by side)")
    parser.add_argument("--disk-sizes", type=_disk_sizes, default=_disk_replay.SIZES,
                        help="--disk's L1,L2,DISK,L2_ONLY fractions (default 0.05,0.05,0.3,0.35)")
    parser.add_argument("--disk-dir", default=None,
                        help="--disk: parent of the disk tier's temporary directory")
    parser.add_argument("--mrc", action="store_true",
                        help="check each configuration's miss-ratio curves against real "
                             "replays with one tier at 0.5x, 2x and 4x (one replay each)")


def run(args: argparse.Namespace) -> dict:
    """Replay the trace ``--trace`` names; a trace that cannot be had or read is a message
    and exit code 2, not a traceback."""
    try:
        with _trace_file(args.trace) as (path, label):
            result = _run(args, path)
    except (TraceDownloadError, TraceError) as exc:
        print(f"bench replay: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    result["trace"] = label
    return result


@contextmanager
def _trace_file(spec: str | None) -> Iterator[tuple[Path, str]]:
    """(path, label) of the trace ``spec`` names: a generated one (in a temporary file for
    the run), a downloaded public one, or a file."""
    if spec is None:
        synth = SynthSpec()
        with tempfile.TemporaryDirectory(prefix="tierstore-trace-") as tmp:
            path = Path(tmp) / "generated_trace.jsonl"
            path.write_text(to_jsonl(synthesize(synth)), encoding="utf-8")
            yield path, f"generated ({synth.describe()})"
        return
    name = trace_name(spec)
    if name is not None:
        yield fetch_trace(name), spec
        return
    if not Path(spec).is_file():
        raise TraceError(f"--trace {spec}: no such file")
    yield Path(spec), spec


def _run(args: argparse.Namespace, trace: Path) -> dict:
    setup = Setup(
        trace=trace, limit=args.limit, model=args.model, page_size=args.page_size,
        l1=args.l1, l2=args.l2, l3=args.l3, configs=args.configs, scale=args.scale,
        scaled_target_bytes=int(args.scaled_mib * 2**20), split=args.split,
        split_warmup=args.split_warmup, decode_s_per_token=args.decode_ms_per_token / 1000,
        seed=args.seed, verify=args.verify, progress=args.progress,
        cost=CostModel(args.prefill_tok_s, args.host_gbps, args.redis_gbps),
        plot=args.plot, window_s=args.window_s, url=args.url, auth_token=args.auth_token,
        speed=args.speed)
    result = run_experiment(setup)
    if args.mrc:
        result["mrc_check"] = mrc_check.check(setup, result)
    if getattr(args, "disk", False):
        result["disk"] = _disk_replay.compare(
            args.model, *args.disk_sizes, requests=load_trace(trace, args.limit),
            page_size=args.page_size, scaled_mib=args.scaled_mib, directory=args.disk_dir)
    return result


def _outcomes(row: dict) -> str:
    """One configuration's prompt tokens: hits by tier, losses by reason."""
    tokens = row["tokens"]
    prompt = tokens["prompt"] or 1
    hit = ", ".join(f"{t} {n / prompt:.1%}" for t, n in tokens["hit"].items() if n)
    lost = ", ".join(f"{r} {n / prompt:.1%}" for r, n in
                     sorted(tokens["lost"].items(), key=lambda kv: -kv[1]) if n)
    return f"{row['config']}: hit {hit or '-'}; lost {lost or '-'}"


def _gib(nbytes: float | None) -> str:
    return "unbounded" if nbytes is None else f"{nbytes / 2**30:,.1f} GiB"


def render(result: dict) -> str:
    caps = result["capacities_real_bytes"]
    scale = result["scale"]
    errors = ", ".join(f"{k} {v:+.2e}" for k, v in scale["ratio_error"].items())
    rows = []
    for r in result["rows"]:
        moved = r["moved_gb"]
        rows.append({
            "config": r["config"], "hit": f"{r['hit_rate']:.1%}",
            "gpu": f"{r['hit_l1']:.1%}", "host": f"{r['hit_l2']:.1%}",
            "redis": f"{r['hit_l3']:.1%}",
            "req_hit": f"{r['requests_hit_rate']:.1%}",
            "demoted_gb": " ".join(f"{k[:2]}>{k[-2:]}:{moved[k]:,.0f}" for k in
                                   ("l1_to_l2", "l1_to_l3", "l2_to_l3") if k in moved) or "-",
            "promoted_gb": " ".join(f"{k[:2]}>{k[-2:]}:{moved[k]:,.0f}" for k in
                                    ("l2_to_l1", "l3_to_l1", "l3_to_l2") if k in moved) or "-",
            "evictions": r["evictions"],
            "saved_s": f"{r['prefill_s_saved']['total']:,.0f}",
            "saved": f"{r['prefill_saved_fraction']:.1%}",
            "wall_s": f"{r['wall_s']:.1f}",
        })
    cost = result["cost_model"]
    ws = result["working_set"]
    entries = ", ".join(f"{k} {v:,}" for k, v in ws["entries"].items())
    lines = [
        f"replay {result['trace']}: {result['requests']} requests over "
        f"{result['trace_seconds']:.0f} s, {result['prompt_tokens']:,} prompt tokens; "
        f"{result['model']}, page {result['page_size']} tokens",
        f"working set {_gib(ws['total_real_bytes'])} ({entries} entries); " + (
            "capacities: the service's own" if "service" in result["configs"] else
            f"L1 {result['sizes']['l1']} = {_gib(caps['l1'])}, L2 {result['sizes']['l2']}"
            f" = {_gib(caps['l2'])}, L3 {result['sizes']['l3']} = {_gib(caps['l3'])}"),
        f"scale 1/{scale['inverse']:g} (envelope ratio error {errors}); fixed split (b): "
        + ", ".join(f"{k} {v:.1%}" for k, v in result["fixed_split"]["shares"].items())
        + f" ({result['fixed_split']['source']}; whole trace: "
        + ", ".join(f"{k} {v:.1%}" for k, v in result["fixed_split"]["whole_trace_shares"].items())
        + ")",
        f"trace upper bound without the hybrid rule (KV pages alone): "
        f"{result['prefix_ideal_kv_only']:.1%} of prompt tokens",
        table(rows, ["config", "hit", "gpu", "host", "redis", "req_hit", "demoted_gb",
                     "promoted_gb", "evictions", "saved_s", "saved", "wall_s"]),
        f"cost model: recompute {cost['prefill_tok_s']:,.0f} tok/s, host {cost['host_gbps']} "
        f"GB/s, Redis {cost['redis_gbps']} GB/s; saved = prefill seconds saved (and the "
        f"fraction of all prompt prefill); GB are real bytes",
        f"runtime {result['runtime_s']:.0f} s" + (f"; plot: {result['plot']}"
                                                   if "plot" in result else ""),
    ]
    for r in result["rows"]:
        if "tokens" in r:
            lines.append(_outcomes(r))
    if "mrc_check" in result:
        lines.append(mrc_check.render(result["mrc_check"]))
    if "disk" in result:
        lines.append(_disk_replay.render(result["disk"]))
    for r in result["rows"]:
        for what, p in r.get("latency_ms", {}).items():
            lines.append(f"{r['config']} {what} latency: p50 {p['p50']:.2f} ms, p90 "
                         f"{p['p90']:.2f} ms, p99 {p['p99']:.2f} ms ({p['n']} calls)")
    return "\n".join(lines)
