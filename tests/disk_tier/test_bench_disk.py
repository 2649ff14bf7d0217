"""``tierstore bench disk`` runs with small parameters and ends with its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def test_bench_disk_small(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tierstore", "bench", "disk", "--json",
                           "--dir", str(tmp_path), "--sizes-kib", "64", "--mib", "2",
                           "--batch-mib", "1", "--repeat", "1", "--scan-mib", "2",
                           "--engines"],
                          capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (row,) = result["rows"]
    assert row["envelope_kib"] == 64 and row["tier_write_mib_s"] > 0
    assert row["read_vs_dd"] > 0 and row["write_vs_dd"] > 0
    scan = result["scan"]
    assert scan["recovered"] == scan["slots"] > 0
    assert set(scan["restart_100gib_s"]) == {"64KiB", "1024KiB", "4096KiB"}
    engines = result["engines"]  # measured, or said why not (aiofiles is not a dependency)
    measured = {r["engine"] for r in engines["rows"]}
    assert {"threads", "threads x1"} <= measured and all(r["read_mib_s"] > 0
                                                         for r in engines["rows"])
    assert measured | set(engines["skipped"]) == {"threads", "threads x1", "aiofiles",
                                                  "io_uring"}


def test_bench_replay_disk_configuration(tmp_path: Path) -> None:
    """`bench replay --disk`: the disk configuration beside the others on the same trace,
    hits and bytes moved per tier and the disk's I/O in the JSON and the text (the code
    `bench disk --replay` runs too)."""
    done = subprocess.run([sys.executable, "-m", "tierstore", "bench", "replay", "--json",
                           "--no-progress", "--configs", "a", "--limit", "40", "--scaled-mib",
                           "32", "--disk", "--disk-dir", str(tmp_path)],
                          capture_output=True, text=True, check=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    disk = json.loads(lines[-1])["disk"]
    assert disk["requests"] == 40 and disk["sizes"]["disk"] == 0.30
    with_disk, without = disk["configs"].values()
    assert set(with_disk["hit_share"]) >= {"l1", "l2", "disk"}
    assert with_disk["disk"]["writes"] > 0 and with_disk["moved_real_mib"]["l2_to_disk"] > 0
    assert without["disk"] is None and without["hit_rate"] >= 0
    assert "disk configuration" in "\n".join(lines[:-1])
    assert list(tmp_path.iterdir()) == []  # the disk's temporary directory is gone


def test_bench_sglang_adapter_on_disk_against_hicachefile(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process: SGLang's import is the slow part, and the adapter's tests share it."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from tierstore.cli import main

    assert main(["bench", "sglang", "--json", "--only-disk", "--cold", "--batch", "4",
                 "--batches", "2", "--rounds", "1", "--page-tokens", "16", "--dir",
                 str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["cold"] and {r["backend"] for r in result["rows"]} == {
        "HiCacheFile", "tierstore on disk"}
    assert all(r["set_durable_mb_s"] > 0 for r in result["rows"])
    assert set(result["vs_file"]["tierstore on disk (v1)"]) == {"set", "get", "set_durable"}
    assert list(tmp_path.iterdir()) == []
