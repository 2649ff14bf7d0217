"""Request bodies in, responses out: msgpack for bulk, JSON for control, one error shape.

Bodies are read within limits (size from ``Content-Length`` before reading, and while a
chunked body streams; time; bytes in flight across requests) and decoded with depth and
key-type limits; request integers are bounded in one place (``check_int``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

MSGPACK = "application/msgpack"
MAX_DEPTH = 8  # container nesting of a request body (the API's bodies need 2)
TOKEN_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class HTTPError(Exception):
    """An error answered as ``{"error": ..., "detail": ...}`` with ``status``."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


def error_response(status: int, error: str, detail: str) -> web.Response:
    return web.json_response({"error": error, "detail": detail}, status=status)


class BodyBudget:
    """Bytes of request bodies held at once across requests (one event loop, no lock)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._freed: asyncio.Event | None = None

    def try_take(self, num_bytes: int) -> bool:
        """Take ``num_bytes`` if they fit now."""
        if self.used + num_bytes > self.capacity:
            return False
        self.used += num_bytes
        return True

    async def take(self, num_bytes: int, timeout_s: float) -> bool:
        """Take ``num_bytes``, waiting up to ``timeout_s`` for other bodies to be released."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.try_take(num_bytes):
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._freed = self._freed or asyncio.Event()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    def give(self, num_bytes: int) -> None:
        """Return ``num_bytes`` taken earlier and wake the waiters."""
        self.used -= num_bytes
        assert self.used >= 0, f"body budget over-released: {self.used}"
        if self._freed is not None:
            self._freed.set()
            self._freed = None


@dataclass(frozen=True)
class BodyLimits:
    """How one request body may be read (``read_raw``)."""

    max_bytes: int
    timeout_s: float
    budget: BodyBudget


BODY_LIMITS = web.AppKey("body_limits", BodyLimits)
# aiohttp >= 3.13 wants typed request keys; older ones take strings.
_HELD: Any = web.RequestKey("body_bytes_held", int) if hasattr(web, "RequestKey") else \
    "tierstore.body_bytes_held"


def release_body(request: web.Request) -> None:
    """Give back the body bytes ``request`` holds (the app's middleware calls this last)."""
    held = request.get(_HELD, 0)
    if held:
        request[_HELD] = 0
        request.config_dict[BODY_LIMITS].budget.give(held)


async def read_raw(request: web.Request) -> bytearray:
    """The request body, within the app's ``BodyLimits``: 413 from ``Content-Length`` before
    anything is read, and while a chunked body streams in; 408 when it takes longer than
    ``timeout_s``; 503 while other bodies hold the in-flight budget. Held until
    ``release_body``."""
    limits = request.config_dict[BODY_LIMITS]
    length = request.content_length
    if length is not None and length > limits.max_bytes:
        raise HTTPError(413, "body_too_large", f"Content-Length {length} exceeds the limit "
                                               f"of {limits.max_bytes} bytes")
    if length is not None and length > 0:
        if not await limits.budget.take(length, limits.timeout_s):
            raise HTTPError(503, "busy", "too many request bodies in flight; retry")
        request[_HELD] = length
    buf, pos = None, 0
    try:
        if length is not None:  # the usual small body is already buffered: no timer, no task
            buf = bytearray(length)
            pos = _take_buffered(request, buf, 0)
            if pos == length:
                return buf
        return await asyncio.wait_for(_read(request, limits, buf, pos), limits.timeout_s)
    except asyncio.TimeoutError:
        raise HTTPError(408, "body_timeout", f"the body did not arrive within "
                                             f"{limits.timeout_s} s") from None
    except (ConnectionError, HttpProcessingError, ClientPayloadError) as exc:
        # The client went away or broke the framing mid-body: its fault, not ours (and
        # whatever we answer may never reach it).
        raise HTTPError(400, "truncated_body", f"the body was cut short: "
                                               f"{type(exc).__name__}") from None


def _take_buffered(request: web.Request, buf: bytearray, pos: int) -> int:
    """Copy what the connection has already buffered into ``buf`` from ``pos``; the new
    position."""
    view = memoryview(buf)
    while pos < len(buf):
        chunk = request.content.read_nowait(len(buf) - pos)
        if not chunk:
            break
        view[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
    return pos


async def _read(request: web.Request, limits: BodyLimits, buf: bytearray | None, pos: int
                ) -> bytearray:
    """The rest of the body: into ``buf`` (the announced size, filled up to ``pos``), or
    chunk by chunk when no size was announced."""
    content = request.content
    if buf is not None:
        view, length = memoryview(buf), len(buf)
        while pos < length:
            chunk = await content.readany()
            if not chunk:
                raise HTTPError(400, "truncated_body", f"{pos} of {length} bytes arrived")
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        return buf
    chunks, total = [], 0
    while chunk := await content.readany():
        total += len(chunk)
        if total > limits.max_bytes:
            raise HTTPError(413, "body_too_large", f"chunked body exceeds the limit of "
                                                   f"{limits.max_bytes} bytes")
        if not limits.budget.try_take(len(chunk)):
            raise HTTPError(503, "busy", "too many request bodies in flight; retry")
        request[_HELD] = request.get(_HELD, 0) + len(chunk)
        chunks.append(chunk)
    return bytearray().join(chunks)


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request body as a dict, read within the app's ``BodyLimits`` (``read_raw``) and
    decoded by Content-Type (``decode_body``)."""
    return decode_body(await read_raw(request), request.content_type)


def decode_body(raw: bytes | bytearray, kind: str) -> dict[str, Any]:
    """``raw`` decoded as msgpack or JSON (``kind``); 400 unless it is an object whose maps,
    at every level, have string keys and nest at most ``MAX_DEPTH`` deep."""
    try:
        if kind in (MSGPACK, "application/x-msgpack"):
            body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        elif kind == "application/json" or not raw:
            body = json.loads(raw) if raw else {}
        else:
            raise HTTPError(400, "unsupported_media_type",
                            f"send application/json or {MSGPACK}, got {kind!r}")
    except RecursionError:
        raise HTTPError(400, "malformed_body", f"the body nests deeper than {MAX_DEPTH} "
                                               f"levels") from None
    except (ValueError, TypeError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError) as exc:
        raise HTTPError(400, "malformed_body", f"cannot decode the {kind} body: "
                                               f"{str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "malformed_body", f"the body must be an object, got "
                                               f"{type(body).__name__}")
    _check_structure(body)
    return body


def _check_structure(body: dict[str, Any]) -> None:
    """400 when a map key is not a string or containers nest deeper than ``MAX_DEPTH``."""
    todo: list[tuple[Any, int]] = [(body, 1)]
    while todo:
        obj, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise HTTPError(400, "malformed_body", f"the body nests deeper than {MAX_DEPTH} "
                                                   f"levels")
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                raise HTTPError(400, "malformed_body", "map keys must be strings")
            items = obj.values()
        else:
            items = obj
        todo += [(v, depth + 1) for v in items if isinstance(v, (dict, list))]


def check_int(value: int, lo: int, hi: int, what: str) -> int:
    """``value`` when ``lo <= value <= hi``, else 400: the one place request integers are
    bounded (token ids, priorities), before any reaches numpy or the store."""
    if not lo <= value <= hi:
        raise HTTPError(400, "out_of_range", f"{what} must be in [{lo}, {hi}], got "
                                             f"{str(value)[:40]}")
    return value


def int_field(body: dict[str, Any], name: str, lo: int, hi: int, *, default: int) -> int:
    """``body[name]``: an int in ``[lo, hi]`` (``default`` when absent)."""
    return check_int(field(body, name, int, default=default), lo, hi, f"field {name!r}")


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], *,
          default: Any = ..., status: int = 400) -> Any:
    """``body[name]`` checked against ``kind``; 400 when missing (without default) or mistyped."""
    if name not in body or body[name] is None:
        if default is ...:
            raise HTTPError(400, "missing_field", f"field {name!r} is required")
        return default
    value = body[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise HTTPError(status, "bad_field", f"field {name!r} must be {names}, got "
                                             f"{type(value).__name__}")
    return value


def tokens_field(body: dict[str, Any], limit: int) -> bytes | np.ndarray:
    """Token ids: packed little-endian uint32 bytes as given, or a list of ints in
    ``[0, 2**32)`` as a uint32 array; 413 beyond ``limit`` ids."""
    tokens = field(body, "tokens", (bytes, list))
    count = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
    if count > limit:
        raise HTTPError(413, "too_many_tokens", f"{count} tokens exceed the limit of {limit}")
    if isinstance(tokens, bytes):
        return tokens
    if not all(type(t) is int for t in tokens):
        bad = next(t for t in tokens if type(t) is not int)
        raise HTTPError(400, "bad_tokens", f"token ids must be ints, got "
                                           f"{type(bad).__name__}")
    if tokens:
        check_int(min(tokens), 0, TOKEN_MAX, "token ids")
        check_int(max(tokens), 0, TOKEN_MAX, "token ids")
    return np.array(tokens, dtype="<u4")


def blobs_field(body: dict[str, Any], name: str, limit: int, *, required: bool = False
                ) -> list[bytes] | None:
    """A list of byte strings (envelopes or values); 413 beyond ``limit`` items."""
    value = field(body, name, list, default=... if required else None)
    if value is None:
        return None
    if len(value) > limit:
        raise HTTPError(413, "batch_too_large", f"{len(value)} items in {name!r} exceed the "
                                                f"limit of {limit}")
    if not all(isinstance(v, bytes) for v in value):
        raise HTTPError(400, "bad_field", f"field {name!r} must be a list of bytes")
    return value


def stack(blobs: list[bytes], unit: int, name: str) -> np.ndarray:
    """Equal-size blobs as one ``[n, unit]`` uint8 array; 422 when a size differs."""
    bad = [i for i, b in enumerate(blobs) if len(b) != unit]
    if bad:
        raise HTTPError(422, "wrong_shape", f"{name}[{bad[0]}] is {len(blobs[bad[0]])} bytes; "
                                            f"this layout's {name} envelope is {unit} bytes")
    out = np.empty((len(blobs), unit), dtype=np.uint8)  # one copy, writable for torch
    for i, blob in enumerate(blobs):
        out[i] = np.frombuffer(blob, dtype=np.uint8)
    return out


def bin_header(length: int) -> bytes:
    """The msgpack header of a bin object of ``length`` bytes (its payload follows it)."""
    if length < 1 << 8:
        return b"\xc4" + length.to_bytes(1, "big")
    if length < 1 << 16:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")


def msgpack_chunks(payload: dict[str, Any]) -> list[Any]:
    """``payload`` as msgpack, in chunks: scalars packed, bytes-like values (and lists of them,
    None allowed) passed through as-is after their headers — nothing large is copied. The
    chunks concatenated equal ``msgpack.packb(payload)``."""
    packer = msgpack.Packer(use_bin_type=True)
    chunks: list[Any] = [packer.pack_map_header(len(payload))]
    for key, value in payload.items():
        chunks.append(packer.pack(key))
        if isinstance(value, list) and any(isinstance(v, (bytes, memoryview)) for v in value):
            chunks.append(packer.pack_array_header(len(value)))
            for item in value:
                chunks += [packer.pack(None)] if item is None else [bin_header(len(item)), item]
        elif isinstance(value, memoryview):
            chunks += [bin_header(value.nbytes), value]
        else:
            chunks.append(packer.pack(value))
    return chunks
