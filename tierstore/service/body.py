"""Request bodies in: msgpack for bulk, JSON for control, read and decoded within limits.

Bodies are read as their bytes arrive, never into a buffer sized from ``Content-Length``:
the in-flight budget counts bytes received, a body passing its route's byte limit is a 413
(a declared length over it is refused before reading), and a body has ``timeout_s`` to
arrive (408). msgpack is decoded while it streams in, with the route's limits on array, map,
string and bin lengths checked at each header; JSON is parsed once whole and only under
``max_json_bytes``. Large bodies are checked (depth, key types) and their token lists packed
into numpy on a worker thread, off the event loop. Errors are one shape (``HTTPError``);
request integers are bounded in one place (``check_int``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

import msgpack
import numpy as np
from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

from tierstore.errors import TierStoreError

MSGPACK = "application/msgpack"
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack")
MAX_DEPTH = 8  # container nesting of a request body (the API's bodies need 2)
TOKEN_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Bodies over this many bytes are checked and converted on a worker thread (a list of this
# many small ints is ~5 ms of Python work on the loop at most).
OFF_LOOP_BYTES = 64 << 10
# Token lists are packed in slices this long: numpy holds the GIL for one slice at a time, so
# the loop thread runs between slices (~2 ms each).
TOKEN_SLICE = 1 << 16
# JSON is parsed in one call that holds the GIL (~45 ms per MiB of ids on a loaded core):
# bulk bodies are msgpack, and JSON bodies stop here.
JSON_MAX_BYTES = 1 << 20


class HTTPError(TierStoreError):
    """An error answered as ``{"error": ..., "detail": ...}`` with ``status``; a 413 for too
    many items also says the route's ``limit``, so a client can split without parsing text."""

    def __init__(self, status: int, error: str, detail: str, *, limit: int | None = None
                 ) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.limit = limit


def error_response(status: int, error: str, detail: str, *, limit: int | None = None
                   ) -> web.Response:
    body: dict[str, Any] = {"error": error, "detail": detail}
    if limit is not None:
        body["limit"] = limit
    return web.json_response(body, status=status)


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
class RouteLimits:
    """What one route's request body may hold: ``max_bytes`` in all (msgpack), or
    ``max_json_bytes`` as JSON; at most ``max_array`` items per array (``array_error`` names
    the 413 beyond it), ``max_map`` pairs per map, ``max_str`` / ``max_bin`` bytes per string /
    byte string. msgpack is checked at each header as it streams in, JSON once parsed."""

    max_bytes: int
    max_json_bytes: int
    max_array: int
    max_map: int = 64
    max_str: int = 1024
    max_bin: int = 1024
    array_error: str = "too_many_items"

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_json_bytes", "max_array", "max_map", "max_str",
                     "max_bin"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def within(cls, max_bytes: int) -> RouteLimits:
        """Limits only as wide as a body of ``max_bytes`` could need."""
        size = max(1, max_bytes)
        return cls(size, min(size, JSON_MAX_BYTES), size, size, size, size)


@dataclass(frozen=True)
class BodyLimits:
    """How request bodies are read: ``max_bytes`` and ``timeout_s`` per body, ``budget``
    across bodies; per path its ``routes`` entry (else ``default``, else limits as wide as
    ``max_bytes``); large bodies are checked on ``executor`` (None: the loop's default)."""

    max_bytes: int
    timeout_s: float
    budget: BodyBudget
    routes: Mapping[str, RouteLimits] = dc_field(default_factory=dict)
    default: RouteLimits | None = None
    executor: Executor | None = None

    def route(self, path: str) -> RouteLimits:
        """The limits of a body sent to ``path``."""
        found = self.routes.get(path) or self.default
        return found if found is not None else RouteLimits.within(self.max_bytes)


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


async def read_raw(request: web.Request, max_bytes: int | None = None) -> bytearray:
    """The request body as it arrived (a buffer grown as bytes come, never sized from
    ``Content-Length``), within ``max_bytes`` (default: the route's); see ``_receive`` for the
    413 / 408 / 503 answers. Its bytes are held in the budget until ``release_body``."""
    limits = request.config_dict[BODY_LIMITS]
    buf = bytearray()
    await _receive(request, limits.route(request.path).max_bytes if max_bytes is None
                   else max_bytes, buf.extend)
    return buf


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request body as a dict, within the app's ``BodyLimits`` and its route's
    ``RouteLimits``: msgpack decoded as it arrives (an array, map, string or bin over the
    route's limits is a 413 at its header, before its items arrive), JSON parsed once whole
    when within ``max_json_bytes``. 400 unless an object whose maps, at every level, have
    string keys and nest at most ``MAX_DEPTH`` deep; a ``tokens`` list comes back as a
    ``<u4`` array. Bodies over ``OFF_LOOP_BYTES`` are checked off the loop."""
    limits = request.config_dict[BODY_LIMITS]
    route = limits.route(request.path)
    kind = request.content_type
    if kind in MSGPACK_TYPES:
        stream = _MsgpackStream(route)
        size = await _receive(request, route.max_bytes, stream.feed)
        return await _off_loop(limits, size, _settle, stream.result(), route)
    buf = bytearray()
    await _receive(request, route.max_json_bytes, buf.extend, f" (send {MSGPACK} for bulk)")
    return await _off_loop(limits, len(buf), decode_body, buf, kind, route)


async def _off_loop(limits: BodyLimits, size: int, fn: Callable[..., dict[str, Any]],
                    *args: Any) -> dict[str, Any]:
    """``fn(*args)``: on the loop for a body of ``size`` up to ``OFF_LOOP_BYTES``, else on
    the limits' executor (a list of 10**6 tokens is ~100 ms of checking and packing)."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(limits.executor, fn, *args)


async def _receive(request: web.Request, max_bytes: int, sink: Callable[[bytes], None],
                   hint: str = "") -> int:
    """Hand the body to ``sink`` chunk by chunk as it arrives; the bytes received. Each chunk
    is taken from the budget before ``sink`` sees it (waiting for other bodies until the
    deadline, then 503). 413 for a declared length over ``max_bytes`` before reading, and as
    soon as the bytes received pass it; 408 when the body takes over ``timeout_s``."""
    limits = request.config_dict[BODY_LIMITS]
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise HTTPError(413, "body_too_large", f"Content-Length {declared} exceeds this "
                                               f"route's limit of {max_bytes} bytes{hint}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.timeout_s
    content, received = request.content, 0
    try:
        while True:
            chunk = content.read_nowait(-1)  # what has arrived: the usual small body, at once
            if not chunk:
                if content.at_eof():
                    break
                chunk = await asyncio.wait_for(content.readany(), deadline - loop.time())
                if not chunk:
                    break
            received += len(chunk)
            if received > max_bytes:
                raise HTTPError(413, "body_too_large", f"the body exceeds this route's limit "
                                                       f"of {max_bytes} bytes{hint}")
            if not limits.budget.try_take(len(chunk)) and \
                    not await limits.budget.take(len(chunk), deadline - loop.time()):
                raise HTTPError(503, "busy", "too many request bodies in flight; retry")
            request[_HELD] = request.get(_HELD, 0) + len(chunk)
            sink(chunk)
    except asyncio.TimeoutError:
        raise HTTPError(408, "body_timeout", f"the body did not arrive within "
                                             f"{limits.timeout_s} s ({received} bytes "
                                             f"came)") from None
    except (ConnectionError, HttpProcessingError, ClientPayloadError) as exc:
        # The client went away or broke the framing mid-body: its fault, not ours (and
        # whatever we answer may never reach it).
        raise HTTPError(400, "truncated_body", f"the body was cut short: "
                                               f"{type(exc).__name__}") from None
    if declared is not None and received < declared:
        raise HTTPError(400, "truncated_body", f"{received} of {declared} bytes arrived")
    return received


class _MsgpackStream:
    """One msgpack object decoded from chunks as they arrive, within ``route``'s limits (the
    decoder checks each container's and string's length at its header and resumes where the
    last chunk ended)."""

    def __init__(self, route: RouteLimits) -> None:
        self._route = route
        self._unpacker = msgpack.Unpacker(
            raw=False, strict_map_key=True, max_buffer_size=route.max_bytes,
            max_array_len=route.max_array, max_map_len=route.max_map,
            max_str_len=route.max_str, max_bin_len=route.max_bin, max_ext_len=0)
        self._fed = 0
        self._done = False
        self._value: Any = None

    def feed(self, chunk: bytes) -> None:
        """Decode ``chunk`` on from where the last one ended; 413 / 400 at the first byte
        that breaks a limit or the format."""
        if self._done:
            raise HTTPError(400, "malformed_body", "bytes follow the body's msgpack object")
        self._fed += len(chunk)
        with _decode_errors(MSGPACK, self._route):
            self._unpacker.feed(chunk)
            try:
                self._value = self._unpacker.unpack()
            except msgpack.OutOfData:
                return
        self._done = True
        if self._unpacker.tell() != self._fed:
            raise HTTPError(400, "malformed_body", "bytes follow the body's msgpack object")

    def result(self) -> Any:
        """The decoded object; 400 when the body ended before it did."""
        if not self._done:
            raise HTTPError(400, "malformed_body", "the msgpack body ends inside an object"
                            if self._fed else "the msgpack body is empty")
        return self._value


@contextmanager
def _decode_errors(kind: str, route: RouteLimits) -> Iterator[None]:
    """Decoder errors as HTTP errors: a limit is 413, anything else malformed (400)."""
    try:
        yield
    except HTTPError:  # ours: already answered
        raise
    except msgpack.exceptions.BufferFull:
        raise HTTPError(413, "body_too_large", f"the body exceeds this route's limit of "
                                               f"{route.max_bytes} bytes") from None
    except RecursionError:
        raise HTTPError(400, "malformed_body", f"the body nests deeper than {MAX_DEPTH} "
                                               f"levels") from None
    except (ValueError, TypeError, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError) as exc:
        text = str(exc)
        if "exceeds max_" in text:  # msgpack's "N exceeds max_array_len(M)", at the header
            if "max_array_len" in text:
                raise HTTPError(413, route.array_error, f"{text[:200]}: over this route's "
                                                        f"limit", limit=route.max_array) from None
            raise HTTPError(413, "item_too_large", f"{text[:200]}: over this route's "
                                                  f"limit") from None
        raise HTTPError(400, "malformed_body", f"cannot decode the {kind} body: "
                                               f"{text[:200]}") from None


def decode_body(raw: bytes | bytearray, kind: str, limits: RouteLimits | None = None
                ) -> dict[str, Any]:
    """``raw`` decoded as msgpack or JSON (``kind``) within ``limits`` (default: as wide as
    ``raw`` could need) and checked as ``read_body`` describes."""
    route = limits or RouteLimits.within(len(raw))
    with _decode_errors(kind, route):
        if kind in MSGPACK_TYPES:
            body = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                                   max_array_len=route.max_array, max_map_len=route.max_map,
                                   max_str_len=route.max_str, max_bin_len=route.max_bin,
                                   max_ext_len=0)
        elif kind == "application/json" or not raw:
            if len(raw) > route.max_json_bytes:
                raise HTTPError(413, "body_too_large", f"a JSON body is limited to "
                                                       f"{route.max_json_bytes} bytes here; "
                                                       f"send {MSGPACK}")
            body = json.loads(raw) if raw else {}
        else:
            raise HTTPError(400, "unsupported_media_type",
                            f"send application/json or {MSGPACK}, got {kind!r}")
    return _settle(body, route)


def _settle(body: Any, route: RouteLimits) -> dict[str, Any]:
    """``body`` checked (an object; string keys; depth; lengths, for JSON) with a ``tokens``
    list packed into a ``<u4`` array."""
    if not isinstance(body, dict):
        raise HTTPError(400, "malformed_body", f"the body must be an object, got "
                                               f"{type(body).__name__}")
    _check_structure(body, route)
    tokens = body.get("tokens")
    if isinstance(tokens, list):
        if len(tokens) > route.max_array:
            raise HTTPError(413, route.array_error, f"{len(tokens)} tokens exceed this "
                                                    f"route's limit of {route.max_array}",
                            limit=route.max_array)
        body["tokens"] = token_array(tokens)
    return body


def _check_structure(body: dict[str, Any], route: RouteLimits) -> None:
    """400 when a map key is not a string or containers nest deeper than ``MAX_DEPTH``; 413
    for a container longer than ``route`` allows (JSON: msgpack checked it as it came). A
    top-level ``tokens`` list is left to ``token_array``, which checks every item."""
    todo: list[tuple[Any, int]] = [(body, 1)]
    while todo:
        obj, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise HTTPError(400, "malformed_body", f"the body nests deeper than {MAX_DEPTH} "
                                                   f"levels")
        if isinstance(obj, dict):
            if len(obj) > route.max_map:
                raise HTTPError(413, "item_too_large", f"a map of {len(obj)} pairs exceeds "
                                                       f"this route's limit of {route.max_map}")
            if not all(isinstance(k, str) for k in obj):
                raise HTTPError(400, "malformed_body", "map keys must be strings")
            items = [v for k, v in obj.items() if obj is not body or k != "tokens"]
        else:
            if len(obj) > route.max_array:
                raise HTTPError(413, route.array_error, f"an array of {len(obj)} items "
                                                        f"exceeds this route's limit of "
                                                        f"{route.max_array}",
                                limit=route.max_array)
            items = obj
        todo += [(v, depth + 1) for v in items if isinstance(v, (dict, list))]


def token_array(tokens: list[Any]) -> np.ndarray:
    """A list of token ids as one ``<u4`` array; 400 unless each is an int in ``[0, 2**32)``.
    Packed ``TOKEN_SLICE`` ids at a time (numpy holds the GIL for one slice only)."""
    out = np.empty(len(tokens), dtype="<u4")
    for start in range(0, len(tokens), TOKEN_SLICE):
        part = tokens[start:start + TOKEN_SLICE]
        if not all(type(t) is int for t in part):
            bad = next(t for t in part if type(t) is not int)
            raise HTTPError(400, "bad_tokens", f"token ids must be ints, got "
                                               f"{type(bad).__name__}")
        try:
            ids = np.array(part, dtype=np.int64)
        except OverflowError:
            check_int(next(t for t in part if not INT64_MIN <= t <= INT64_MAX), 0, TOKEN_MAX,
                      "token ids")
            raise
        if ids.size:
            check_int(int(ids.min()), 0, TOKEN_MAX, "token ids")
            check_int(int(ids.max()), 0, TOKEN_MAX, "token ids")
        out[start:start + len(part)] = ids
    return out


def check_int(value: int, lo: int, hi: int, what: str) -> int:
    """``value`` when ``lo <= value <= hi``, else 400: the one place request integers are
    bounded (token ids, priorities), before any reaches numpy or the store."""
    if not lo <= value <= hi:
        raise HTTPError(400, "out_of_range", f"{what} must be in [{lo}, {hi}], got "
                                             f"{str(value)[:40]}")
    return value
