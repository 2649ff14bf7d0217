"""The CLI: every benchmark runs with small parameters and ends with one JSON object."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tierstore.cli import main


def last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_bench_retention_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "retention", "--prefixes", "10", "--json"]) == 0
    result = last_json(capsys)
    one = {r["rule"]: r for r in result["rows"] if r["allocation"] == "one"}
    assert one["unified"]["retained"] > one["per_kind"]["retained"]
    assert one["unified"]["evictions"] < one["per_kind"]["evictions"]
    ratio = result["one_allocation"]["retained_ratio"]  # undefined (None) when per_kind kept none
    assert ratio is None if one["per_kind"]["retained"] == 0 else ratio > 1


def test_bench_arena_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "arena", "--quick", "--sizes-kib", "16", "--compact-mib", "1",
                 "--requests", "300", "--capacity-gib", "4", "--json"]) == 0
    result = last_json(capsys)
    c = result["concurrency"]
    assert c["arena"] >= c["best_fixed"] * 0.98 and c["arena"] >= c["misset_fixed"]
    assert result["compaction"][0]["moved_mib"] == 1


def test_python_m_tierstore_is_the_cli() -> None:
    """``python -m tierstore`` parses and runs like the ``tierstore`` command."""
    done = subprocess.run([sys.executable, "-m", "tierstore", "bench", "--help"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: tierstore bench") and "retention" in done.stdout
    done = subprocess.run([sys.executable, "-m", "tierstore", "no-such-command"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_demo_hits_every_tier_and_beats_gpu_only(redis_bin: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """What ``make demo`` shows: hits from L1, L2 and L3 (the private server), more than a
    GPU-only cache on the same requests, the dashboard URL, the reference model's repeat."""
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    rates = dict(re.findall(r"^  (L[123]) .*? ([\d.]+)%$", out, flags=re.MULTILINE))
    assert set(rates) == {"L1", "L2", "L3"}, out
    assert min(float(r) for r in rates.values()) > 0, rates
    total = re.search(r"token hit rate ([\d.]+)%", out)
    gpu_only = re.search(r"^GPU-only .* hit rate ([\d.]+)%", out, flags=re.MULTILINE)
    assert total and gpu_only and float(total[1]) > float(gpu_only[1]), out
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/dashboard", out, flags=re.MULTILINE)
    assert "logits identical: True" in out


def test_bench_split_json(redis_bin: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One 17 MiB value: two 16 MiB-chunk parts against one whole value, bytes checked."""
    assert main(["bench", "split", "--sizes-mib", "17", "--values", "1", "--rounds", "2",
                 "--no-cluster", "--json"]) == 0
    (row,) = last_json(capsys)["rows"]
    assert row["topology"] == "standalone" and row["size_mib"] == 17
    assert min(row["split_put"], row["whole_put"], row["split_get"], row["whole_get"]) > 0


def test_bench_mac_json(redis_bin: str, capsys: pytest.CaptureFixture[str]) -> None:
    """256 KiB values (handed to the hashing threads) through every tag; ratios reported."""
    assert main(["bench", "mac", "--sizes", "256K", "--rounds", "1", "--total-mb", "4",
                 "--keyspace-mb", "2", "--callers", "2", "--batch", "2", "--json"]) == 0
    (row,) = last_json(capsys)["rows"]
    assert row["size_kib"] == 256 and min(row["blake3_get"], row["nomac_get"]) > 0
    assert row["blake3_get_vs_nomac"] is not None and row["blake3_put_loop_vs_xxh3"] is not None
