"""``bench http``'s same-host rows and load mix run end to end (tiny sizes) and check bytes."""

from __future__ import annotations

import argparse

import pytest

from host_tier import shm
from tierstore.bench import http as bench


@pytest.mark.skipif(not shm.available(1 << 30), reason="no usable /dev/shm")
def test_bench_http_runs_small() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--pages", "2", "--fetches", "2", "--matches", "10",
                                          "--clients", "2", "--rounds", "2", "--repeat", "1"]))
    assert result["shm_get_mb_s"] > 0 and result["torch_copy_mb_s"] > 0
    for transport in ("http", "shm"):
        mix = result["mix"][transport]
        assert mix["wrong_bytes"] == 0 and mix["requests"] == 2 * 2 * 5, mix
        assert mix["shm_clients"] == (2 if transport == "shm" else 0)
    assert "shm / torch copy" in bench.render(result)
