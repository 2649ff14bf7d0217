"""The LMCache contender of ``bench redis``: its driver script and the switch that turns it off."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tierstore.bench import redis as bench_redis
from tierstore.cli import main


def test_driver_help_runs_without_lmcache() -> None:
    # The driver runs in another venv; it may import lmcache only inside main().
    done = subprocess.run(
        [sys.executable, str(bench_redis._LMCACHE_DRIVER), "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--url" in done.stdout and "--rounds" in done.stdout


def test_driver_rejects_size_off_the_chunk_grid() -> None:
    done = subprocess.run(
        [sys.executable, str(bench_redis._LMCACHE_DRIVER), "--url", "redis://x:1",
         "--size", "1000", "--count", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode != 0 and "multiple of 1024" in done.stderr


def test_bench_redis_lmcache_off(
    redis_benchmark: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "redis", "--sizes", "4K", "--total-mb", "1", "--keyspace-mb", "1",
                 "--rounds", "1", "--lmcache-python", "", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["lmcache"]["status"] == "off"
    assert "lmcache_get" not in result["rows"][0] and "get_vs_lmcache" not in result["rows"][0]
    assert any(line.startswith("LMCache: off") for line in out)


def test_bench_redis_lmcache_absent(
    redis_benchmark: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = f"{tmp_path}/no-venv/bin/python"
    assert main(["bench", "redis", "--sizes", "4K", "--total-mb", "1", "--keyspace-mb", "1",
                 "--rounds", "1", "--lmcache-python", missing, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["lmcache"] == {"status": "absent", "reason": f"{missing} not found",
                                 "python": missing}
    assert "lmcache_get" not in result["rows"][0]


def test_bench_redis_lmcache_not_importable(
    redis_benchmark: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # With a Python that has no lmcache, the driver says so and the bench reports it.
    if importlib.util.find_spec("lmcache") is not None:
        pytest.skip("lmcache is installed in this venv")
    assert main(["bench", "redis", "--sizes", "4K", "--total-mb", "1", "--keyspace-mb", "1",
                 "--rounds", "1", "--lmcache-python", sys.executable, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["lmcache"]["status"] == "absent"
    assert "lmcache" in result["lmcache"]["reason"]
    assert "lmcache_get" not in result["rows"][0]


@pytest.mark.skipif(not os.path.exists(bench_redis._LMCACHE_PYTHON), reason="no LMCache venv")
def test_bench_redis_with_lmcache(redis_benchmark: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "redis", "--sizes", "4K", "--total-mb", "1", "--keyspace-mb", "1",
                 "--rounds", "1", "--lmcache-python", bench_redis._LMCACHE_PYTHON,
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["lmcache"]["status"] == "on", result["lmcache"]
    row = result["rows"][0]
    assert row["lmcache_get"] > 0 and row["lmcache_put"] > 0
    assert row["get_vs_lmcache"] == row["tier_get"] / row["lmcache_get"]
    assert row["put_vs_lmcache"] == row["tier_put"] / row["lmcache_put"]
