"""``tierstore bench ops``: fill and steady phases, bytes moved while filling, and the side-by-side
systems (the floor always; vLLM / SGLang where they import, else a stated reason)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from tierstore.bench import ops
from tierstore.bench._ops_acct import turn_order
from tierstore.bench._ops_vs import make_systems
from tierstore.layout import load_preset


def _args(**over: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ops.add_arguments(parser)
    args = parser.parse_args([])
    vars(args).update({"sizes": "300,900", "requests": 40, "real_pages": 0, "turn": 16,
                       "fill_min_requests": 60, **over})
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


def test_short_fills_repeat_on_fresh_systems_until_the_minimum() -> None:
    """A fill shorter than ``--fill-min-requests`` runs again on fresh systems (same prompts, so
    the same length each time) until the phase has run the minimum; a long fill runs once. The
    per-operation split and the headline are over every fill."""
    result = ops.run(_args(sizes="300,900", fill_min_requests=60))
    assert result["fill_min_requests"] == 60
    for r in result["rows"]:
        n, repeats = r["fill_requests"], r["fill_repeats"]
        assert repeats == -(-60 // n)  # the fewest fills that reach the minimum
        assert r["fill_requests_total"] == repeats * n >= 60
        assert (repeats - 1) * n < 60
        # The split's parts are timed inside the timed loop's turns, over the same requests.
        parts = sum(r[f"fill_us_{op}"] for op in ops.OPS)
        assert 0 < parts <= r["fill_timed_us_per_request"]
        assert r["same_hits"] and r["failed"] == 0 and r["moved_per_allocated"] == 0
    small, large = result["rows"]
    assert small["fill_repeats"] > large["fill_repeats"] >= 1
    once = ops.run(_args(sizes="900", fill_min_requests=0))["rows"][0]
    assert once["fill_repeats"] == 1 and once["fill_requests"] == large["fill_requests"]
    assert "fill_repeats" in ops.render(result)
    with pytest.raises(SystemExit, match="--fill-min-requests -1 < 0"):
        ops.run(_args(fill_min_requests=-1))
    # The drift-free companion of fill_growth: the store's fill over floor-hashlib's, per row.
    assert result["fill_growth_vs_floor_hashlib"] == pytest.approx(
        large["fill_vs_floor_hashlib"] / small["fill_vs_floor_hashlib"])
    assert small["fill_vs_floor_hashlib"] == pytest.approx(
        small["fill_us_per_request"] / small["systems"]["floor-hashlib"]["fill_us_per_request"])


def test_the_accounting_pair_alternates_and_reports_per_turn_spread() -> None:
    """The pair is split around the floor-hashlib and swaps slots every turn (``alternate``), or
    runs on-then-off back to back (``fixed``); beside the total rise, the per-turn median,
    quartiles and extremes, and the rise by which side went first."""
    # t(imed), f(loor), g (floor-hashlib), then the pair (n: on, o: off).
    assert turn_order(list("tfgno"), ["n", "o"], 0, "alternate", "f") == list("tfngo")
    assert turn_order(list("tfgno"), ["n", "o"], 1, "alternate", "f") == list("tfogn")
    assert turn_order(list("fgno"), ["n", "o"], 3, "alternate", "f") == list("fogn")
    assert turn_order(list("tfgno"), ["n", "o"], 1, "alternate") == list("otfgn")
    assert turn_order(list("tfgno"), ["n", "o"], 1, "fixed", "f") == list("tfgno")
    assert turn_order(list("ab"), [], 1, "alternate") == list("ab")
    with pytest.raises(ValueError, match="pair order"):
        turn_order(list("ab"), [], 0, "random")
    for order in ("alternate", "fixed"):
        result = ops.run(_args(sizes="300", accounting_off=True, pair_order=order))
        json.dumps(result)
        assert result["pair_order"] == order
        row = result["rows"][0]
        for phase in ("fill", "steady"):
            f = row["accounting"][phase]
            assert f["same_hits"] and f["failed"] == 0 and f["order"] == order
            assert f["turns"] >= 2 and f["rise_iqr"] == pytest.approx(f["rise_q3"] - f["rise_q1"])
            assert f["rise_min"] <= f["rise_q1"] <= f["rise_median"] <= f["rise_q3"] \
                <= f["rise_max"]
            assert f["rise_min"] <= f["rise"] <= f["rise_max"]  # a total lies within its turns
            if order == "fixed":  # on went first every turn: that total is the total
                assert f["rise_off_first"] is None
                assert f["rise_on_first"] == pytest.approx(f["rise"])
            else:
                assert f["rise_on_first"] is not None and f["rise_off_first"] is not None
        # Steady: 40 requests in turns of 16; fill: at least one turn per fill run.
        assert row["accounting"]["steady"]["turns"] == 3
        assert row["accounting"]["fill"]["turns"] >= row["fill_repeats"]
        assert result["max_accounting_rise_median"] == row["accounting"]["steady"][
            "rise_median"]
        assert f"({order} order)" in ops.render(result)


def test_bench_runs_with_vllm_skipped_when_it_does_not_import(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--vs vllm`` where vLLM cannot be imported: the bench runs (fill repeats included) and
    says why vLLM's systems are missing."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")] or ["vllm"]:
        monkeypatch.setitem(sys.modules, name, None)  # ``import vllm...`` raises ImportError
    result = ops.run(_args(sizes="300", vs="vllm", requests=20))
    row = result["rows"][0]
    assert set(row["skipped"]) == {"vllm-hybrid", "vllm-1group"}
    assert all("not importable" in why for why in row["skipped"].values())
    assert not any(name.startswith("vllm") for name in row["systems"])
    assert row["fill_repeats"] > 1 and row["us_per_request"] > 0
    assert "skipped vllm-hybrid" in ops.render(result)
