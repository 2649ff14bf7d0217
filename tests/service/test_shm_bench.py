"""``bench http``'s same-host rows and load mix run end to end (tiny sizes) and check bytes."""

from __future__ import annotations

import argparse
import json

import pytest

from host_tier import shm
from tierstore.bench import http as bench
from tierstore.bench._util import ratio


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


def test_a_ratio_against_a_zero_figure_is_undefined() -> None:
    # A tiny mix can measure 0 s of service CPU (the clock counts 10 ms ticks): the ratio is
    # null in JSON and "n/a" in the text, not a ZeroDivisionError.
    assert ratio(3.0, 0.0) is None and ratio(None, 2.0) is None and ratio(3.0, 2.0) == 1.5
    assert json.dumps({"r": ratio(1, 0)}) == '{"r": null}'
    mix = {"clients": 2, "requests": 20, "requests_s": 100.0, "p50_ms": 1.0, "p99_ms": 2.0,
           "service_cpu_ms": 0.0, "service_cores": 0.0, "store_thread_busy": None,
           "wrong_bytes": 0, "shm_clients": 0}
    result = {"envelope_bytes": 1 << 20, "pages_per_fetch": 2, "fetch_mb_s": 1.0,
              "echo_mb_s": 0.0, "fetch_vs_echo": ratio(1.0, 0.0), "match_rps": 1.0,
              "match_concurrency": 1, "fetch_payload_mib": 2.0, "shm_get_mb_s": 1.0,
              "http_get_mb_s": 1.0, "torch_copy_mb_s": 1.0, "shm_vs_copy": 1.0,
              "mix": {"http": mix, "shm": mix}, "mix_shm_vs_http": 1.0,
              "mix_cpu_http_vs_shm": ratio(0.0, 0.0)}
    text = bench.render(result)
    assert "service / bare = n/a" in text and "request n/ax less" in text
