"""Generated request traces in the Mooncake format: ``tierstore trace synth``, and the replay's
default trace (so ``tierstore bench replay`` needs no file beside it).

The model: requests arrive as a Poisson process at ``rate`` per second. Each arrival either
opens a conversation (with probability ``1 / turns``, or when none is open) or is the next turn
of an open one, picked uniformly, so conversations interleave and a small cache has to choose.
A conversation opens, with probability ``prefix_share``, with one of ``prefix_groups`` shared
prefixes (system prompts, documents) of ``prefix_blocks`` blocks, group ``g`` chosen with
weight ``1 / (g + 1) ** prefix_skew``; then its own first message of ``turn_blocks`` blocks.
Each later turn repeats the whole previous prompt and adds ``turn_blocks`` blocks (the answer
and the next message); a conversation closes after ``turns`` turns. Outputs are exponential
with mean ``output_tokens``; the last block of a prompt is partial.

Hash ids follow Mooncake's rule (a shared id means a shared prefix up to it) and are numbered
in order of first appearance. The same spec and seed give the same bytes, on any platform:
the draws come from :class:`random.Random`, whose sequence Python keeps stable.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tierstore.replay.trace import BLOCK_TOKENS, TraceError


@dataclass(frozen=True)
class SynthSpec:
    """The parameters of a generated trace (see the module docstring for the model)."""

    requests: int = 300
    prefix_groups: int = 16  # distinct shared prefixes
    prefix_blocks: int = 8  # blocks of BLOCK_TOKENS tokens per shared prefix
    prefix_share: float = 0.5  # fraction of conversations that open with a shared prefix
    prefix_skew: float = 1.0  # Zipf exponent of the groups' popularity (0: uniform)
    turns: int = 3  # turns per conversation
    turn_blocks: int = 3  # blocks a turn adds to the conversation
    rate: float = 2.0  # requests per second, on average
    output_tokens: int = 200  # mean output length
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("requests", "turns", "turn_blocks", "output_tokens")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TraceError(f"synth {name} = {value!r} must be a positive integer")
        for name in ("prefix_groups", "prefix_blocks", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TraceError(f"synth {name} = {value!r} must be a non-negative integer")
        if not 0.0 <= self.prefix_share <= 1.0:
            raise TraceError(f"synth prefix_share = {self.prefix_share!r} must be in [0, 1]")
        if self.prefix_share > 0 and (self.prefix_groups == 0 or self.prefix_blocks == 0):
            raise TraceError("synth prefix_share > 0 needs prefix_groups and prefix_blocks > 0")
        if not self.prefix_skew >= 0.0:
            raise TraceError(f"synth prefix_skew = {self.prefix_skew!r} must be >= 0")
        if not self.rate > 0.0:
            raise TraceError(f"synth rate = {self.rate!r} must be > 0 requests per second")

    def describe(self) -> str:
        """The command that writes this trace."""
        flags = " ".join(f"--{f.name.replace('_', '-')} {getattr(self, f.name)}"
                         for f in fields(self) if getattr(self, f.name) != f.default)
        return f"tierstore trace synth {flags}".strip()


def synthesize(spec: SynthSpec) -> list[dict[str, Any]]:
    """The trace of ``spec``: one record per request, in arrival order."""
    rng = random.Random(spec.seed)
    weights = [1.0 / (g + 1) ** spec.prefix_skew for g in range(spec.prefix_groups)]
    ids: dict[tuple[str, int, int], int] = {}
    open_: list[list[int]] = []  # per open conversation: [conversation, group or -1, turn]
    records: list[dict[str, Any]] = []
    clock, opened = 0.0, 0
    for _ in range(spec.requests):
        clock += rng.expovariate(spec.rate)
        if not open_ or rng.random() < 1.0 / spec.turns:
            shared = spec.prefix_share > 0 and rng.random() < spec.prefix_share
            group = rng.choices(range(spec.prefix_groups), weights)[0] if shared else -1
            conv = [opened, group, 0]
            opened += 1
            open_.append(conv)
        else:
            conv = open_[rng.randrange(len(open_))]
        number, group, turn = conv
        keys = [("p", group, j) for j in range(spec.prefix_blocks if group >= 0 else 0)]
        keys += [("c", number, j) for j in range((turn + 1) * spec.turn_blocks)]
        hash_ids = [ids.setdefault(k, len(ids)) for k in keys]
        cut = rng.randrange(BLOCK_TOKENS)  # the last block is partial
        output = max(1, round(rng.expovariate(1.0 / spec.output_tokens)))
        records.append({"timestamp": int(clock * 1000), "input_length":
                        len(hash_ids) * BLOCK_TOKENS - cut, "output_length": output,
                        "hash_ids": hash_ids})
        conv[2] += 1
        if conv[2] == spec.turns:
            open_.remove(conv)
    return records


def to_jsonl(records: list[dict[str, Any]]) -> str:
    """Records as trace text: one JSON object per line."""
    return "".join(json.dumps(r) + "\n" for r in records)


def summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """Requests, seconds, blocks, distinct blocks and the block hit ratio of an infinite
    cache (the figure Mooncake's trace README gives)."""
    blocks = [i for r in records for i in r["hash_ids"]]
    distinct = len(set(blocks))
    return {"requests": len(records),
            "seconds": records[-1]["timestamp"] / 1000 if records else 0.0,
            "blocks": len(blocks), "distinct_blocks": distinct,
            "infinite_block_hit": 1 - distinct / len(blocks) if blocks else 0.0}


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``tierstore trace synth``'s flags: one per :class:`SynthSpec` field, and ``-o``."""
    helps = {"requests": "requests in the trace", "prefix_groups": "distinct shared prefixes",
             "prefix_blocks": f"blocks of {BLOCK_TOKENS} tokens per shared prefix",
             "prefix_share": "fraction of conversations opening with a shared prefix",
             "prefix_skew": "Zipf exponent of the prefixes' popularity (0: uniform)",
             "turns": "turns per conversation", "turn_blocks": "blocks each turn adds",
             "rate": "requests per second (Poisson)", "output_tokens": "mean output tokens",
             "seed": "random seed (same seed, same bytes)"}
    for f in fields(SynthSpec):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=f.default,
                            type=type(f.default), help=f"{helps[f.name]} (default {f.default})")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="write the trace here (default: standard output)")


def main(args: argparse.Namespace) -> int:
    """Write the trace ``args`` describe; a summary goes to stderr (stdout with ``-o``)."""
    spec = SynthSpec(**{f.name: getattr(args, f.name) for f in fields(SynthSpec)})
    records = synthesize(spec)
    text = to_jsonl(records)
    if args.output is None:
        sys.stdout.write(text)
        report = sys.stderr
    else:
        args.output.write_text(text, encoding="utf-8")
        report = sys.stdout
    s = summary(records)
    print(f"{args.output or 'stdout'}: {s['requests']} requests over {s['seconds']:.0f} s, "
          f"{s['blocks']} blocks ({s['distinct_blocks']} distinct): an infinite cache would "
          f"hit {s['infinite_block_hit']:.1%} of blocks; spec {json.dumps(asdict(spec))}",
          file=report)
    return 0
