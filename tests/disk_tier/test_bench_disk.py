"""``tierstore bench disk`` runs with small parameters and ends with its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_disk_small(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tierstore", "bench", "disk", "--json",
                           "--dir", str(tmp_path), "--sizes-kib", "64", "--mib", "2",
                           "--batch-mib", "1", "--repeat", "1", "--scan-mib", "2"],
                          capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (row,) = result["rows"]
    assert row["envelope_kib"] == 64 and row["tier_write_mib_s"] > 0
    assert row["read_vs_dd"] > 0 and row["write_vs_dd"] > 0
    scan = result["scan"]
    assert scan["recovered"] == scan["slots"] > 0
    assert set(scan["restart_100gib_s"]) == {"64KiB", "1024KiB", "4096KiB"}
