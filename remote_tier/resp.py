"""A minimal RESP2 connection built for large values (the tier's data path).

redis-py's asyncio client reads replies through a ``StreamReader``: each value is copied
several times before the caller sees it, which caps a 1 MiB GET at well under half of what
the server can send. This connection is an ``asyncio.BufferedProtocol``: while the body of a
bulk string arrives, ``get_buffer`` hands the transport the destination itself (a caller's
buffer, a pooled receive buffer, or a fresh uninitialised one), so the kernel copies each
byte once. Large arguments are written as separate buffers, never joined, under TCP_CORK.
The copies run in the event loop, each bounded by what the socket holds (well under a
millisecond); nothing blocks it.

Requests are pipelined: each ``send`` appends replies-to-come to a FIFO, and Redis answers
one connection's commands in order. A connection that fails (closed, protocol error, or no
byte received for ``timeout_s`` while replies are owed) fails every pending reply with
``RemoteUnavailable`` and is never reused. Error replies are returned as ``ServerError``
values, not raised, so one failed command does not hide its neighbours' replies.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np

from remote_tier.errors import ProtocolError, RemoteUnavailable, ServerError, server_error

log = logging.getLogger(__name__)

Part: TypeAlias = "bytes | bytearray | memoryview"
Arg: TypeAlias = "bytes | str | int | memoryview | tuple[Part, ...]"  # a tuple is one argument
Reply: TypeAlias = (
    "int | str | bytes | memoryview | ServerError | list[Reply] | tuple[memoryview, ...] | None"
)
# (position in the top-level reply, bulk length) -> buffers to fill in order, or None to let the
# connection allocate; a filled bulk's reply is the tuple of those buffers.
BulkSink: TypeAlias = "Callable[[int, int], Sequence[memoryview] | None]"

_TCP_CORK: int | None = getattr(socket, "TCP_CORK", None)  # Linux only
_SCRATCH_BYTES = 64 * 1024  # read size for reply lines and small values
_SMALL_READ = 1024  # read size for the reply line after a large value
_INLINE_ARG_BYTES = 16 * 1024  # larger arguments are written as their own buffer
_UNINIT_BULK_BYTES = 64 * 1024  # larger bulks are received into uninitialised memory


class _Pending:
    __slots__ = ("future", "sink")

    def __init__(self, future: asyncio.Future[Reply], sink: BulkSink | None) -> None:
        self.future = future
        self.sink = sink


def _encode(commands: Sequence[Sequence[Arg]]) -> list[Part]:
    """RESP for ``commands`` as few buffers: small parts joined, large ones by reference."""
    chunks: list[Part] = []
    buf = bytearray()
    for cmd in commands:
        buf += b"*%d\r\n" % len(cmd)
        for arg in cmd:
            parts: tuple[Part, ...]
            if isinstance(arg, tuple):
                parts = arg
            elif isinstance(arg, str):
                parts = (arg.encode(),)
            elif isinstance(arg, int):
                parts = (b"%d" % arg,)
            else:
                parts = (arg,)
            size = 0
            for part in parts:
                size += len(part)
            buf += b"$%d\r\n" % size
            for part in parts:
                if len(part) >= _INLINE_ARG_BYTES:
                    chunks.append(bytes(buf))
                    chunks.append(part)
                    buf = bytearray()
                else:
                    buf += part
            buf += b"\r\n"
    if buf:
        chunks.append(buf)
    return chunks


class RespConnection(asyncio.BufferedProtocol):
    """One connection (TCP or unix socket) to one Redis server. Open with
    ``await RespConnection.open(...)``."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._sock: Any = None  # the transport's socket, for TCP_CORK
        self._queue: deque[_Pending] = deque()
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._last_progress = 0.0
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._scratch_view = memoryview(self._scratch)
        self._rbuf = bytearray()  # received bytes not yet parsed
        # parse state of the reply being received
        self._arrays: list[tuple[int, list[Reply]]] = []  # (expected length, items so far)
        self._segments: Sequence[memoryview] = ()
        self._bulk: memoryview | None = None
        self._seg_index = 0
        self._seg_offset = 0
        self._body_left = 0  # body bytes still to receive, then CRLF
        self._in_body = False
        self._header_read = _SCRATCH_BYTES  # bytes to read when no body is being received
        self.num_bytes_in = 0

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        timeout_s: float,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        path: str | None = None,
    ) -> RespConnection:
        """Connect (to the unix socket ``path`` when given, else ``host:port``), authenticate
        and select ``db``; ``RemoteUnavailable`` on any failure (never naming the password)."""
        loop = asyncio.get_running_loop()
        where = path if path is not None else f"{host}:{port}"
        try:
            connect = (
                loop.create_unix_connection(lambda: cls(timeout_s), path)
                if path is not None
                else loop.create_connection(lambda: cls(timeout_s), host, port)
            )
            _, conn = await asyncio.wait_for(connect, timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            if isinstance(exc, asyncio.TimeoutError):
                raise RemoteUnavailable("timeout", f"connect to {where}") from None
            raise RemoteUnavailable("connection", f"{where}: {exc}") from None
        try:
            setup: list[Sequence[Arg]] = []
            if password is not None:
                setup.append(("AUTH", username, password) if username else ("AUTH", password))
            if db:
                setup.append(("SELECT", db))
            if setup:
                for reply in await asyncio.gather(*conn.send(setup)):
                    if isinstance(reply, ServerError):
                        raise RemoteUnavailable("auth", f"{where}: {reply}")
        except BaseException:
            conn.abort()
            raise
        return conn

    # -- requests -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether this connection can take no more requests."""
        return self._closed

    @property
    def num_pending(self) -> int:
        """Replies still owed by the server."""
        return len(self._queue)

    def send(
        self, commands: Sequence[Sequence[Arg]], sinks: Sequence[BulkSink | None] | None = None
    ) -> list[asyncio.Future[Reply]]:
        """Write ``commands`` in one go; one future per command, resolved in order."""
        if self._closed or self._transport is None:
            raise RemoteUnavailable("connection", "connection is closed")
        chunks = _encode(commands)
        futures: list[asyncio.Future[Reply]] = []
        for i in range(len(commands)):
            fut: asyncio.Future[Reply] = self._loop.create_future()
            self._queue.append(_Pending(fut, sinks[i] if sinks is not None else None))
            futures.append(fut)
        if len(self._queue) == len(commands):
            self._last_progress = self._loop.time()
        self._write(chunks)
        self._arm_timer()
        return futures

    def _write(self, chunks: list[Part]) -> None:
        """Send ``chunks`` in order without joining (copying) them. Corked, so small command
        heads, large values and CRLFs leave as full segments instead of one packet each
        (every packet wakes the server); the transport buffers only an unsent tail."""
        assert self._transport is not None, "write before connection_made"
        if len(chunks) == 1:
            self._transport.write(chunks[0])
            return
        self._cork(True)
        for chunk in chunks:
            self._transport.write(chunk)
        self._cork(False)

    def _cork(self, on: bool) -> None:
        if _TCP_CORK is not None and self._sock is not None:
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, on)
            except OSError:
                self._sock = None  # not TCP after all; stop trying

    def abort(self) -> None:
        """Drop the connection now; pending replies fail (also used on caller cancellation,
        so no late reply is ever written into a buffer the caller has taken back)."""
        self._fail(RemoteUnavailable("connection", "connection aborted"))

    # -- asyncio protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport), "RESP needs a stream transport"
        self._transport = transport
        sock = transport.get_extra_info("socket")
        # TCP_CORK only applies to TCP; a unix socket sends each write whole anyway.
        tcp = sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
        self._sock = sock if tcp else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RemoteUnavailable("connection", f"connection lost: {exc or 'closed by peer'}"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._in_body and not self._rbuf and self._body_left > 0:
            segment = self._segments[self._seg_index]
            return segment[self._seg_offset :]
        # Between bodies: after a large bulk, the next reply is likely large too, so read
        # little — whatever lands here past its header line is copied into the body later.
        return self._scratch_view[: self._header_read]

    def buffer_updated(self, nbytes: int) -> None:
        self.num_bytes_in += nbytes
        self._last_progress = self._loop.time()
        if self._in_body and not self._rbuf and self._body_left > 0:
            self._advance_body(nbytes)  # the bytes landed in the destination already
        else:
            self._rbuf += self._scratch_view[:nbytes]
        try:
            self._parse()
        except ProtocolError as exc:
            log.warning("dropping redis connection: %s", exc)
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost fails what is pending

    # -- parsing --------------------------------------------------------------------------------

    def _advance_body(self, nbytes: int) -> None:
        self._body_left -= nbytes
        self._seg_offset += nbytes
        while self._seg_index < len(self._segments) and self._seg_offset >= len(
            self._segments[self._seg_index]
        ):
            self._seg_offset -= len(self._segments[self._seg_index])
            self._seg_index += 1

    def _parse(self) -> None:
        rbuf = self._rbuf
        pos = 0
        while True:
            if self._in_body:
                if self._body_left > 0:
                    if pos >= len(rbuf):
                        break
                    take = min(self._body_left, len(rbuf) - pos)
                    with memoryview(rbuf) as received:
                        while take:
                            segment = self._segments[self._seg_index]
                            n = min(take, len(segment) - self._seg_offset)
                            segment[self._seg_offset : self._seg_offset + n] = received[
                                pos : pos + n
                            ]
                            pos += n
                            take -= n
                            self._advance_body(n)
                    continue
                if len(rbuf) - pos < 2:
                    break
                if rbuf[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("bulk string not followed by CRLF")
                pos += 2
                self._in_body = False
                bulk, self._bulk = self._bulk, None
                self._emit(bulk if bulk is not None else tuple(self._segments))
                self._segments = ()
                continue
            end = rbuf.find(b"\r\n", pos)
            if end < 0:
                if len(rbuf) - pos > _SCRATCH_BYTES:
                    raise ProtocolError("reply line longer than 64 KiB")
                break
            marker, line = rbuf[pos], bytes(rbuf[pos + 1 : end])
            pos = end + 2
            self._handle_line(marker, line)
        del rbuf[:pos]

    def _handle_line(self, marker: int, line: bytes) -> None:
        try:
            if marker == 0x2B:  # +
                self._emit(line.decode())
            elif marker == 0x2D:  # -
                self._emit(server_error(line.decode(errors="replace")))
            elif marker == 0x3A:  # :
                self._emit(int(line))
            elif marker == 0x24:  # $
                self._start_bulk(int(line))
            elif marker == 0x2A:  # *
                count = int(line)
                if count < 0:
                    self._emit(None)
                elif count == 0:
                    self._emit([])
                else:
                    self._arrays.append((count, []))
            else:
                raise ProtocolError(f"unknown reply type byte {marker:#x}")
        except ValueError as exc:
            raise ProtocolError(f"bad reply line {line[:40]!r}") from exc

    def _start_bulk(self, length: int) -> None:
        if length < 0:
            self._emit(None)
            return
        if not self._queue:
            raise ProtocolError("bulk reply with no request pending")
        sink = self._queue[0].sink
        position = len(self._arrays[0][1]) if self._arrays else 0
        segments = sink(position, length) if sink is not None else None
        if segments is None:
            # Uninitialised memory for large values: zero-filling 4 MiB costs a third as much
            # as receiving it.
            self._bulk = (
                np.empty(length, np.uint8).data
                if length >= _UNINIT_BULK_BYTES
                else memoryview(bytearray(length))
            )
            segments = (self._bulk,)
        elif sum(len(s) for s in segments) != length:
            raise ProtocolError("bulk sink returned buffers of the wrong total size")
        self._segments = segments
        self._seg_index = 0
        self._seg_offset = 0
        self._advance_body(0)  # skip leading empty segments
        self._body_left = length
        self._in_body = True
        self._header_read = _SMALL_READ if length >= _UNINIT_BULK_BYTES else _SCRATCH_BYTES

    def _emit(self, value: Reply) -> None:
        while self._arrays:
            count, items = self._arrays[-1]
            items.append(value)
            if len(items) < count:
                return
            self._arrays.pop()
            value = items
        if not self._queue:
            raise ProtocolError("reply with no request pending")
        pending = self._queue.popleft()
        if not pending.future.done():
            pending.future.set_result(value)

    # -- failure and the no-progress watchdog ---------------------------------------------------

    def _fail(self, exc: Exception) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queue, self._queue = self._queue, deque()
        for pending in queue:
            if not pending.future.done():
                pending.future.set_exception(exc)
                pending.future.exception()  # seen: a cancelled caller may never await it
        self._segments = ()
        self._bulk = None
        if self._transport is not None:
            self._transport.abort()

    def _arm_timer(self) -> None:
        if self._timer is None and self._queue and not self._closed:
            self._timer = self._loop.call_at(
                self._last_progress + self._timeout_s, self._check_progress
            )

    def _check_progress(self) -> None:
        self._timer = None
        if not self._queue or self._closed:
            return
        if self._loop.time() - self._last_progress >= self._timeout_s:
            log.warning("redis made no progress for %.3f s; dropping connection", self._timeout_s)
            self._fail(RemoteUnavailable("timeout", f"no reply byte for {self._timeout_s} s"))
            return
        self._arm_timer()
