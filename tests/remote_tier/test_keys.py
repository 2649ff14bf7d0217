"""Key layout: format, validation, parsing, namespace separation, slot grouping."""

from __future__ import annotations

import fnmatch

import pytest

from remote_tier.errors import BadKey
from remote_tier.keys import (
    KeyParts,
    envelope_key,
    is_part_key,
    key_slot,
    parse_key,
    part_key,
    raw_key,
    scan_pattern,
)
from remote_tier.transfer import group_keys

H = "0123456789abcdef"


def test_envelope_key_format() -> None:
    assert envelope_key("ts", "fpA", H, "kv") == f"ts:fpA:{H}:kv"
    assert parse_key("ts", f"ts:fpA:{H}:state") == KeyParts("state", "fpA")


def test_raw_key_format_and_parse() -> None:
    key = raw_key("ts", "vllm@model@0@abc:def")
    assert key == "ts:raw:vllm@model@0@abc:def"
    assert parse_key("ts", key) == KeyParts("raw", "")


@pytest.mark.parametrize(
    "parts",
    [
        ("", "fp", H, "kv"),
        ("a:b", "fp", H, "kv"),
        ("t*", "fp", H, "kv"),
        ("ts", "f:p", H, "kv"),
        ("ts", "raw", H, "kv"),
        ("ts", "fp[1]", H, "kv"),
        ("ts", "fp", "XYZ", "kv"),
        ("ts", "fp", "abc", "kv"),
        ("ts", "fp", H.upper(), "kv"),
        ("ts", "fp", H, "KV"),
        ("ts", "fp", H, "raw"),
        ("ts", "fp", H, "k:v"),
    ],
)
def test_bad_envelope_key_parts_raise(parts: tuple[str, str, str, str]) -> None:
    with pytest.raises(BadKey):
        envelope_key(*parts)


@pytest.mark.parametrize("key", ["", "has space", "x" * 601, "tab\tkey", "é"])
def test_bad_raw_keys_raise(key: str) -> None:
    with pytest.raises(BadKey):
        raw_key("ts", key)


@pytest.mark.parametrize(
    "key",
    ["other:fp:" + H + ":kv", "ts", "ts:", "ts:fp:" + H, "ts:fp:nothex:kv", "tsx:fp:" + H + ":kv"],
)
def test_parse_rejects_foreign_or_malformed_keys(key: str) -> None:
    with pytest.raises(BadKey):
        parse_key("ts", key)


def test_bad_key_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_key("ts", "nope")


def test_namespaces_never_collide() -> None:
    keys = {
        envelope_key(prefix, fp, H, kind)
        for prefix in ("a", "ab", "a.b")
        for fp in ("f", "fb", "f-b")
        for kind in ("kv", "swa", "state")
    }
    assert len(keys) == 27
    assert raw_key("a", f"f:{H}:kv") not in keys
    # every key parses back under exactly its own prefix
    for key in keys:
        prefix = key.split(":")[0]
        assert parse_key(prefix, key).kind in {"kv", "swa", "state"}
        for other in {"a", "ab", "a.b"} - {prefix}:
            with pytest.raises(BadKey):
                parse_key(other, key)


def test_part_keys_never_collide_and_match_scan_patterns() -> None:
    key = envelope_key("ts", "fp1", H, "kv").encode()
    raw = raw_key("ts", "a#1").encode()
    assert part_key(key, 0) == key and part_key(key, 12) == key + b" #12"
    assert not is_part_key(key) and not is_part_key(raw) and is_part_key(part_key(raw, 1))
    for part in (part_key(key, 1), part_key(raw, 3)):
        with pytest.raises(BadKey):
            parse_key("ts", part.decode())
    assert fnmatch.fnmatchcase(part_key(key, 7).decode(), scan_pattern("ts", "fp1"))
    assert fnmatch.fnmatchcase(part_key(raw, 7).decode(), scan_pattern("ts"))


def test_scan_pattern() -> None:
    assert scan_pattern("ts") == "ts:*"
    assert scan_pattern("ts", "fp1") == "ts:fp1:*"
    with pytest.raises(BadKey):
        scan_pattern("ts", "fp*")


def test_key_slot_matches_redis() -> None:
    # reference values from CLUSTER KEYSLOT
    assert key_slot(b"foo") == 12182
    assert key_slot(b"{user1000}.following") == key_slot(b"{user1000}.followers")


def test_group_keys_standalone_contiguous_and_spread() -> None:
    keys = [f"k{i}".encode() for i in range(10)]
    groups = group_keys(keys, list(range(10)), cluster=False, max_keys=64, spread=4)
    assert [i for g in groups for i in g] == list(range(10))
    assert len(groups) >= 4 and max(len(g) for g in groups) == 3
    groups = group_keys(keys, list(range(10)), cluster=False, max_keys=2, spread=1)
    assert [len(g) for g in groups] == [2] * 5


def test_group_keys_cluster_never_mixes_slots() -> None:
    keys = [envelope_key("ts", "fp", f"{i:016x}", "kv").encode() for i in range(300)]
    keys += [b"{tag}a", b"{tag}b", b"{tag}c"]
    idxs = list(range(len(keys)))
    groups = group_keys(keys, idxs, cluster=True, max_keys=2, spread=1)
    assert sorted(i for g in groups for i in g) == idxs
    for group in groups:
        assert len({key_slot(keys[i]) for i in group}) == 1
        assert len(group) <= 2
        assert group == sorted(group)
    assert [300, 301] in groups
