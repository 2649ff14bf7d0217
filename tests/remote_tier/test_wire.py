"""Wire format: round trip, zero-copy views, MAC tags, and every rejection."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from remote_tier import wire
from remote_tier.errors import CorruptValue, OldFormat
from remote_tier.mac import Mac
from tierstore.testing.l3_forger import old_checksum_value

KEY = b"t:fp1:0123456789abcdef:kv"
MAC = Mac(b"wire-test-secret-" * 2)


def _value(payload: bytes, *, kind: str = "kv", fp: str = "fp1", key: bytes = KEY) -> bytes:
    return wire.encode(MAC, key, kind, fp, payload)


def _decode(value: bytes | bytearray | memoryview, *, key: bytes = KEY, kind: str = "kv",
            fp: str = "fp1", mac: Mac = MAC) -> memoryview:
    return wire.decode(mac, value, key_b=key, kind=kind, layout_fp=fp)


@pytest.mark.parametrize("size", [0, 1, 255, 4096, 1 << 20])
def test_round_trip_is_bytes_identical(size: int) -> None:
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    value = _value(payload)
    got = _decode(value)
    assert isinstance(got, memoryview)
    assert got.tobytes() == payload
    assert len(value) == wire.header_size("kv", "fp1", size) + size


def test_decode_returns_a_view_not_a_copy() -> None:
    value = bytearray(_value(b"abcdef"))
    got = _decode(value)
    value[-1] = ord("z")
    assert got.tobytes() == b"abcdez"


def test_accepts_any_contiguous_buffer() -> None:
    arr = np.arange(64, dtype=np.uint32)
    value = wire.encode(MAC, KEY, "state", "fp", arr)
    got = _decode(memoryview(value), kind="state", fp="fp")
    assert got.tobytes() == arr.tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        wire.as_bytes_view(arr.reshape(8, 8)[:, ::2])


def test_header_size_does_not_depend_on_the_tag() -> None:
    sizes = {
        len(wire.encode_header(MAC, KEY, "kv", "fp", memoryview(bytes([i]) * 100)))
        for i in range(50)
    }
    assert sizes == {wire.header_size("kv", "fp", 100)}


def _header(*fields: object) -> bytes:
    return msgpack.packb(list(fields), use_bin_type=True)


GOOD = b"payload!"
SUM = wire.tag(MAC, KEY, "kv", "fp1", GOOD)
V, S = wire.FORMAT_VERSION, wire.SPLIT_FORMAT_VERSION


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"", "unreadable"),
        (b"\xc1" + GOOD, "unreadable"),  # 0xc1 is never valid msgpack
        (b"\x95\x01", "unreadable"),  # truncated header
        (_header(V, "kv", "fp1", len(GOOD)) + GOOD, "5-field"),
        (msgpack.packb({"v": 1}) + GOOD, "5-field"),
        (_header(S, "kv", "fp1", len(GOOD), SUM) + GOOD, "7-field"),
        (_header(V, 7, "fp1", len(GOOD), SUM) + GOOD, "strings"),
        (_header(V, "kv", "fp1", -1, SUM) + GOOD, "length"),
        (_header(V, "kv", "fp1", len(GOOD), SUM[:4]) + GOOD, "tag field"),
        (_header(V, "swa", "fp1", len(GOOD), SUM) + GOOD, "kind"),
        (_header(V, "kv", "fp2", len(GOOD), SUM) + GOOD, "layout fingerprint"),
        (_header(V, "kv", "fp1", len(GOOD), SUM) + GOOD[:-1], "payload is 7 bytes"),
        (_header(V, "kv", "fp1", len(GOOD), SUM) + GOOD + b"x", "payload is 9 bytes"),
        (_header(V, "kv", "fp1", len(GOOD), SUM) + b"paylo4d!", "MAC mismatch"),
        (_header(9, "kv", "fp1", len(GOOD), SUM) + GOOD, "version 9"),
    ],
)
def test_every_bad_value_is_rejected(value: bytes, reason: str) -> None:
    with pytest.raises(CorruptValue, match=reason):
        _decode(value)


def test_good_header_built_by_hand_is_accepted() -> None:
    value = _header(V, "kv", "fp1", len(GOOD), SUM) + GOOD
    assert _decode(value).tobytes() == GOOD


def test_tag_binds_the_key_kind_layout_fingerprint_and_part_count() -> None:
    other = b"t:fp1:fedcba9876543210:kv"
    value = _value(GOOD)
    with pytest.raises(wire.BadTag, match="another key"):
        _decode(value, key=other)
    tags = {
        SUM,
        wire.tag(MAC, other, "kv", "fp1", GOOD),
        wire.tag(MAC, KEY, "kv", "fp2", GOOD),
        wire.tag(MAC, KEY, "swa", "fp1", GOOD),
        wire.tag(MAC, KEY, "kv", "fp1", GOOD, 2),
    }
    assert len(tags) == 5
    # length prefixes: moving a byte between key and header changes the tag
    assert MAC.sign(b"ab", b"c", GOOD) != MAC.sign(b"a", b"bc", GOOD)


def test_a_value_signed_with_another_secret_is_rejected() -> None:
    """What a Redis writer without the deployment's secret can make never verifies."""
    forged = wire.encode(Mac(b"the-forger's-own-secret" * 2), KEY, "kv", "fp1", b"forged!!")
    with pytest.raises(wire.BadTag):
        _decode(forged)
    assert _decode(wire.encode(Mac(b"wire-test-secret-" * 2), KEY, "kv", "fp1", GOOD))


@pytest.mark.parametrize("version", wire.OLD_VERSIONS)
def test_values_before_the_mac_are_old_format(version: int) -> None:
    fields = [version, "kv", "fp1", len(GOOD), SUM[:8]] + ([0, 2] if version in (2, 4) else [])
    with pytest.raises(OldFormat, match=f"format version {version}"):
        _decode(_header(*fields) + GOOD)
    if version == 3:  # a correct old-style checksum changes nothing
        with pytest.raises(OldFormat):
            _decode(old_checksum_value(KEY.decode(), GOOD))


# -- split values (format 6) ----------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [4096, 5000, 1 << 16])
def test_parts_cover_the_payload_in_near_equal_spans(chunk: int) -> None:
    for total in [0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk, 7 * chunk + 3, 4096 * chunk]:
        num = wire.num_parts(total, chunk)
        assert num == max(1, -(-total // chunk))
        spans = [wire.part_span(total, num, i) for i in range(num)]
        assert spans[0][0] == 0 and spans[-1][1] == total
        assert all(spans[i][1] == spans[i + 1][0] for i in range(num - 1))
        sizes = [hi - lo for lo, hi in spans]
        assert max(sizes) <= chunk and (num == 1 or min(sizes) > 0)
        assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]
    assert wire.num_parts(10 << 20, 0) == 1


def test_part_header_round_trip_and_size() -> None:
    digest = wire.tag(MAC, KEY, "kv", "fp1", b"whole payload", 2)
    for index, num in [(0, 2), (1, 2), (127, 200), (128, 200), (4095, 4096)]:
        header = wire.encode_part_header("kv", "fp1", 10**9, digest, index, num)
        assert len(header) == wire.part_header_size("kv", "fp1", 10**9, index, num)
        assert len(header) <= wire.MAX_HEADER_BYTES
        got, size = wire.read_header(memoryview(header + b"body"))
        assert got == wire.Header(S, "kv", "fp1", 10**9, digest, index, num) and size == len(header)
    sizes = {
        len(wire.encode_part_header("kv", "fp", 5000, bytes([i]) * 16, 1, 3)) for i in range(50)
    }
    assert sizes == {wire.part_header_size("kv", "fp", 5000, 1, 3)}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ((S, "kv", "fp1", 9000, SUM, 0), "7-field"),
        ((S, "kv", "fp1", 9000, SUM, 0, 1), "part count"),
        ((S, "kv", "fp1", 9000, SUM, 0, 4097), "part count"),
        ((S, "kv", "fp1", 9000, SUM, 0, True), "part count"),
        ((S, "kv", "fp1", 9000, SUM, 3, 3), "part index"),
        ((S, "kv", "fp1", 9000, SUM, -1, 3), "part index"),
        ((S, "kv", "fp1", 3, SUM, 0, 4), "cannot fill"),
        ((S, "kv", "fp1", -5, SUM, 0, 2), "length"),
    ],
)
def test_bad_part_headers_are_rejected(fields: tuple[object, ...], reason: str) -> None:
    with pytest.raises(CorruptValue, match=reason):
        wire.read_header(memoryview(_header(*fields) + GOOD))


def test_a_part_is_not_a_whole_value() -> None:
    value = wire.encode_part_header("kv", "fp1", 2 * len(GOOD), SUM, 0, 2) + GOOD
    with pytest.raises(CorruptValue, match="not a whole value"):
        _decode(value)
