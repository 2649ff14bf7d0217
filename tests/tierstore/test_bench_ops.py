"""``tierstore bench ops``: fill and steady phases, bytes moved while filling, and the side-by-side
systems (the floor always; vLLM / SGLang where they import, else a stated reason)."""

from __future__ import annotations

import argparse
import json

from tierstore.bench import ops
from tierstore.bench._ops_vs import make_systems
from tierstore.layout import load_preset


def _args(**over: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ops.add_arguments(parser)
    args = parser.parse_args([])
    vars(args).update({"sizes": "300,900", "requests": 40, "real_pages": 0, "turn": 16,
                       **over})
    return args


def test_rows_time_fill_and_steady_state_on_the_same_prompts() -> None:
    result = ops.run(_args())
    json.dumps(result)  # the --json line
    rows = result["rows"]
    assert [r["pages"] for r in rows] == [300, 900]
    for r in rows:
        # Filling from empty to the first eviction takes about capacity / new pages per request.
        assert r["pages"] // 48 <= r["fill_requests"] <= r["pages"] // 24 + 1
        assert r["fill_us_per_request"] > 0 and r["us_per_request"] > 0
        assert r["failed"] == 0 and r["evictions_per_request"] > 0
        # gpt-oss: the SWA band starts at byte 0, the KV band grows down to it: nothing moves.
        assert r["moved_per_allocated"] == 0
        assert set(r["systems"]) >= {"tierstore", "tierstore-timed", "floor"}
        # The headline is a second store run bare beside the timed one: same cache, same hits.
        assert r["same_hits"] and r["timed_us_per_request"] > 0
        assert r["systems"]["tierstore"]["evictions"] == r["systems"]["tierstore-timed"][
            "evictions"]
        assert r["systems"]["floor"]["evictions"] > 0
    assert result["fill_growth"] is not None and result["growth"] is not None
    assert "fill (empty cache to the first eviction)" in ops.render(result)


def test_state_and_kv_layout_fills_without_moves() -> None:
    """State (low) and KV (high) bands grow toward each other: filling moves nothing either
    (three-pool layouts, where a float band slides, are pinned in tests/gpu_arena)."""
    result = ops.run(_args(model="qwen3-next-80b-a3b", sizes="400"))
    row = result["rows"][0]
    assert row["moved_per_allocated"] == 0 and row["fill_requests"] > 0


def test_vs_engines_run_or_say_why_not() -> None:
    layout = load_preset("gpt-oss-20b", page_size=16)
    systems, skipped = make_systems(["vllm", "sglang"], layout, 200)
    names = {s.name for s in systems} | set(skipped)
    assert names == {"vllm-hybrid", "vllm-1group", "sglang-radix"}
    assert all(reason for reason in skipped.values())
    result = ops.run(_args(sizes="300", vs="vllm,sglang", requests=20))
    row = result["rows"][0]
    for s in systems:  # an importable engine ran the same loop and evicted
        assert row["systems"][s.name]["us_per_request"] > 0
        assert row[f"vs_{s.name}"] is not None
    assert set(row["skipped"]) == set(skipped)
