"""Wire format: round trip, zero-copy views, and every rejection."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from remote_tier import wire
from remote_tier.errors import CorruptValue


def _value(payload: bytes, *, kind: str = "kv", fp: str = "fp1") -> bytes:
    return wire.encode(kind, fp, payload)


@pytest.mark.parametrize("size", [0, 1, 255, 4096, 1 << 20])
def test_round_trip_is_bytes_identical(size: int) -> None:
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    value = _value(payload)
    got = wire.decode(value, kind="kv", layout_fp="fp1")
    assert isinstance(got, memoryview)
    assert got.tobytes() == payload
    assert len(value) == wire.header_size("kv", "fp1", size) + size


def test_decode_returns_a_view_not_a_copy() -> None:
    value = bytearray(_value(b"abcdef"))
    got = wire.decode(value, kind="kv", layout_fp="fp1")
    value[-1] = ord("z")
    assert got.tobytes() == b"abcdez"


def test_accepts_any_contiguous_buffer() -> None:
    arr = np.arange(64, dtype=np.uint32)
    value = wire.encode("state", "fp", arr)
    assert wire.decode(memoryview(value), kind="state", layout_fp="fp").tobytes() == arr.tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        wire.as_bytes_view(arr.reshape(8, 8)[:, ::2])


def test_header_size_does_not_depend_on_checksum() -> None:
    sizes = {len(wire.encode_header("kv", "fp", memoryview(bytes([i]) * 100))) for i in range(50)}
    assert sizes == {wire.header_size("kv", "fp", 100)}


def _header(*fields: object) -> bytes:
    return msgpack.packb(list(fields), use_bin_type=True)


GOOD = b"payload!"
SUM = wire.checksum(GOOD)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"", "unreadable"),
        (b"\xc1" + GOOD, "unreadable"),  # 0xc1 is never valid msgpack
        (b"\x95\x01", "unreadable"),  # truncated header
        (_header(1, "kv", "fp1", len(GOOD)) + GOOD, "5-field"),
        (msgpack.packb({"v": 1}) + GOOD, "5-field"),
        (_header(2, "kv", "fp1", len(GOOD), SUM) + GOOD, "version"),
        (_header(1, 7, "fp1", len(GOOD), SUM) + GOOD, "strings"),
        (_header(1, "kv", "fp1", -1, SUM) + GOOD, "length"),
        (_header(1, "kv", "fp1", len(GOOD), SUM[:4]) + GOOD, "checksum field"),
        (_header(1, "swa", "fp1", len(GOOD), SUM) + GOOD, "kind"),
        (_header(1, "kv", "fp2", len(GOOD), SUM) + GOOD, "layout fingerprint"),
        (_header(1, "kv", "fp1", len(GOOD), SUM) + GOOD[:-1], "payload is 7 bytes"),
        (_header(1, "kv", "fp1", len(GOOD), SUM) + GOOD + b"x", "payload is 9 bytes"),
        (_header(1, "kv", "fp1", len(GOOD), SUM) + b"paylo4d!", "checksum mismatch"),
    ],
)
def test_every_bad_value_is_rejected(value: bytes, reason: str) -> None:
    with pytest.raises(CorruptValue, match=reason):
        wire.decode(value, kind="kv", layout_fp="fp1")


def test_good_header_built_by_hand_is_accepted() -> None:
    value = _header(1, "kv", "fp1", len(GOOD), SUM) + GOOD
    assert wire.decode(value, kind="kv", layout_fp="fp1").tobytes() == GOOD
