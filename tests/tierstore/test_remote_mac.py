"""The store's L3 bridge keys its MAC from the deployment secret ``settings`` finds: instances
given the same secret share L3 pages, an instance with another one reads misses."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_tier import RemoteTierConfig
from tierstore.remote import RemoteBridge


def _bridge(url: str, mac_key: bytes | None = None) -> RemoteBridge:
    return RemoteBridge(RemoteTierConfig(url=url, key_prefix="rb", mac_key=mac_key), "fp1")


def test_bridges_share_pages_under_one_secret_and_miss_under_another(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no user key file is used
    monkeypatch.setenv("TIERSTORE_MAC_KEY", "a" * 40)
    page = bytes(range(256)) * 64
    writer, reader = _bridge(redis_url), _bridge(redis_url)
    other = _bridge(redis_url, mac_key=b"b" * 40)  # an explicit key wins over the environment
    try:
        key = writer.key(b"\x01" * 16, "kv")
        assert writer.put([(key, page)]) == [True]
        got = reader.get([key])
        assert got is not None and got[0] is not None and bytes(got[0]) == page
        assert other.get([key]) == [None]
        assert other.stats()["num_mac_failures"] == 1
        assert reader.get([key]) == [None]  # the stranger deleted what it could not verify
        assert not (tmp_path / "tierstore").exists()
    finally:
        for bridge in (writer, reader, other):
            bridge.close()
