"""RemoteTierConfig validation."""

from __future__ import annotations

import pytest

from remote_tier.config import RemoteTierConfig


def test_defaults_and_endpoint() -> None:
    config = RemoteTierConfig(url="redis://u:p%40ss@127.0.0.1:7000/3")
    ep = config.endpoint()
    assert (ep.host, ep.port, ep.db, ep.username, ep.password) == (
        "127.0.0.1",
        7000,
        3,
        "u",
        "p@ss",
    )
    assert RemoteTierConfig().endpoint().port == 6379


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": "rediss://h:1"}, "scheme"),
        ({"url": "http://h:1"}, "scheme"),
        ({"url": "unix://h/tmp/r.sock"}, "not a host"),
        ({"url": "unix:///tmp/r.sock?x=1"}, "unknown parameters"),
        ({"url": "redis://:1"}, "no host"),
        ({"url": "redis://h:1/x"}, "db number"),
        ({"mode": "sentinel"}, "mode"),
        ({"mode": "cluster", "url": "redis://h:1/2"}, "db 2"),
        ({"key_prefix": "a:b"}, "key_prefix"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"max_value_bytes": 10}, "max_value_bytes"),
        ({"max_value_bytes": 1 << 30}, "max_value_bytes"),
        ({"op_timeout_s": 0}, "op_timeout_s"),
        ({"connections": 0}, "connections"),
        ({"pipeline_bytes": 10}, "pipeline_bytes"),
        ({"batch_keys": 0}, "batch_keys"),
        ({"breaker_failures": 0}, "breaker_failures"),
        ({"breaker_cooldown_s": 5.0, "breaker_max_cooldown_s": 1.0}, "breaker_cooldown_s"),
        ({"chunk_bytes": 4095}, r"chunk_bytes must be 0 or in \[4096, 67108608\]"),
        ({"chunk_bytes": -1}, "chunk_bytes"),
        ({"chunk_bytes": (64 << 20) - 255}, "got 67108609"),
        ({"max_value_bytes": 8192}, r"\[4096, 7936\].*got 16777216"),
    ],
)
def test_rejects_bad_values_with_numbers(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RemoteTierConfig(**kwargs)  # type: ignore[arg-type]


def test_chunk_bytes_bounds() -> None:
    assert RemoteTierConfig().chunk_bytes == 16 << 20
    assert RemoteTierConfig(chunk_bytes=0, max_value_bytes=1024).chunk_bytes == 0
    assert RemoteTierConfig(chunk_bytes=4096, max_value_bytes=4096 + 256).chunk_bytes == 4096
    assert RemoteTierConfig(chunk_bytes=(64 << 20) - 256).chunk_bytes == (64 << 20) - 256


def test_frozen() -> None:
    config = RemoteTierConfig()
    with pytest.raises(AttributeError):
        config.connections = 2  # type: ignore[misc]
