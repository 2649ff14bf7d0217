"""``tierstore bench soak`` end to end, briefly: a real service subprocess, Redis killed and
restarted under load, every byte read back checked."""

from __future__ import annotations

import argparse

from tierstore.bench import soak


def test_short_soak_with_a_redis_kill_reads_no_wrong_bytes(redis_bin: str) -> None:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    args = parser.parse_args(["--clients", "3", "--seconds", "4", "--kill-redis-at", "1",
                              "--redis-down", "1", "--abuse", "20"])
    result = soak.run(args)
    assert result["wrong_values"] == 0 and result["wrong_bytes"] == 0
    assert result["http_5xx"] == 0, result["errors"]
    assert result["verified"].get("kv_pages", 0) > 0 and result["verified"].get("values", 0) > 0
    assert set(result["endpoints"]) == set(soak.MIX)
    assert "redis SIGKILLed" in " ".join(result["events"])
    assert result["abuse"]["idle_opened"] >= 20
    assert "wrong bytes 0" in soak.render(result)
