"""RESP connection parser, fed by hand through the BufferedProtocol interface, in pieces of
every size (a fake transport: the parser's job is independent of the socket)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from remote_tier.errors import Moved, ProtocolError, RemoteUnavailable, ServerError
from remote_tier.resp import Reply, RespConnection


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


def _connect() -> tuple[RespConnection, FakeTransport]:
    conn = RespConnection(timeout_s=5.0)
    transport = FakeTransport()
    conn.connection_made(transport)
    return conn, transport


def _feed(conn: RespConnection, data: bytes, piece: int) -> None:
    pos = 0
    while pos < len(data):
        buf = conn.get_buffer(-1)
        n = min(piece, len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        conn.buffer_updated(n)
        pos += n


REPLIES = (
    b"+OK\r\n"
    b":42\r\n"
    b"$5\r\nhello\r\n"
    b"$-1\r\n"
    b"*3\r\n$1\r\na\r\n$-1\r\n$0\r\n\r\n"
    b"-MOVED 3999 127.0.0.1:7001\r\n"
    b"-ERR wrong\r\n"
    b"*2\r\n:1\r\n*1\r\n$2\r\nhi\r\n"
    b"*0\r\n"
)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, 100_000])
async def test_parses_every_reply_type_in_any_split(piece: int) -> None:
    conn, transport = _connect()
    futures = conn.send([("PING",)] * 9)
    _feed(conn, REPLIES, piece)
    got = [f.result() for f in futures]
    assert got[:5] == ["OK", 42, bytearray(b"hello"), None, [bytearray(b"a"), None, bytearray()]]
    assert isinstance(got[5], Moved) and isinstance(got[6], ServerError)
    assert not isinstance(got[6], Moved)
    assert got[7] == [1, [bytearray(b"hi")]] and got[8] == []
    assert conn.num_pending == 0 and not transport.aborted


async def test_encodes_commands_and_multipart_values() -> None:
    conn, transport = _connect()
    big = memoryview(b"x" * 20_000)
    conn.send([("SET", b"k", (b"hd", big), "PX", 5)])
    expected = b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$20002\r\nhd" + big.tobytes()
    expected += b"\r\n$2\r\nPX\r\n$1\r\n5\r\n"
    assert bytes(transport.written) == expected


@pytest.mark.parametrize("piece", [1, 5, 1 << 20])
async def test_bulk_sink_receives_into_caller_buffers(piece: int) -> None:
    conn, _ = _connect()
    head, body = bytearray(3), bytearray(6)
    calls: list[tuple[int, int]] = []

    def sink(position: int, length: int) -> Sequence[memoryview] | None:
        calls.append((position, length))
        if length == 9:
            return (memoryview(head), memoryview(body))
        return None

    (fut,) = conn.send([("MGET", "a", "b", "c")], [sink])
    _feed(conn, b"*3\r\n$9\r\nHDRpayld!\r\n$-1\r\n$2\r\nzz\r\n", piece)
    reply: Reply = fut.result()
    assert isinstance(reply, list)
    assert bytes(head) == b"HDR" and bytes(body) == b"payld!"
    assert isinstance(reply[0], tuple) and reply[1] is None and reply[2] == bytearray(b"zz")
    assert calls == [(0, 9), (2, 2)]


async def test_protocol_error_fails_pending_and_aborts() -> None:
    conn, transport = _connect()
    (fut,) = conn.send([("PING",)])
    _feed(conn, b"?what\r\n", 100)
    with pytest.raises(ProtocolError):
        fut.result()
    assert transport.aborted and conn.closed
    with pytest.raises(RemoteUnavailable):
        conn.send([("PING",)])


async def test_connection_lost_fails_pending() -> None:
    conn, _ = _connect()
    futures = conn.send([("GET", "a"), ("GET", "b")])
    _feed(conn, b"$3\r\nab", 100)
    conn.connection_lost(None)
    for fut in futures:
        with pytest.raises(RemoteUnavailable, match="connection"):
            fut.result()


async def test_no_progress_times_out() -> None:
    conn = RespConnection(timeout_s=0.05)
    transport = FakeTransport()
    conn.connection_made(transport)
    (fut,) = conn.send([("GET", "a")])
    with pytest.raises(RemoteUnavailable, match="timeout"):
        await asyncio.wait_for(fut, 2.0)
    assert transport.aborted


async def test_progress_keeps_a_slow_transfer_alive() -> None:
    conn = RespConnection(timeout_s=0.08)
    conn.connection_made(FakeTransport())
    (fut,) = conn.send([("GET", "a")])
    data = b"$10\r\n0123456789\r\n"
    for i in range(len(data)):  # one byte every 30 ms: 0.5 s total, never 80 ms idle
        _feed(conn, data[i : i + 1], 1)
        await asyncio.sleep(0.03)
    assert fut.result() == bytearray(b"0123456789")
