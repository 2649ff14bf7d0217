"""``tierstore bench kernels`` runs and reports every contender (tiny sizes)."""

from __future__ import annotations

import argparse

from tierstore.bench import kernels as bench


def test_bench_runs_small() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--sizes", "16K,256K", "--total-mb", "1", "--rounds", "1",
                              "--ids", "2000", "--page-size", "4", "--table-slots", "4096",
                              "--no-gpu"])
    result = bench.run(args)
    methods = {(r["size_kib"], r["method"]) for r in result["copy"]}
    assert methods == {(k, m) for k in (16, 256) for m in bench._METHODS}
    assert all(r["gb_s"] > 0 for r in result["copy"])
    assert [r["page_size"] for r in result["remap"]] == [1, 4]
    sync = result["table_sync"]
    assert [(r["slots"], r["changed"]) for r in sync] == [(65536, 16), (65536, 1024),
                                                           (4096, 16), (4096, 1024)]
    assert all(r["patch_us"] > 0 and r["full_copy_us"] > 0 for r in sync)
    text = bench.render(result)
    assert "strided_copy" in text and "ids_per_s" in text
