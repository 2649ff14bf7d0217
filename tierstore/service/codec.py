"""Request bodies in, responses out: msgpack for bulk, JSON for control, one error shape."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import numpy as np
from aiohttp import web

MSGPACK = "application/msgpack"


class HTTPError(Exception):
    """An error answered as ``{"error": ..., "detail": ...}`` with ``status``."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


def error_response(status: int, error: str, detail: str) -> web.Response:
    return web.json_response({"error": error, "detail": detail}, status=status)


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request body as a dict, decoded by Content-Type (msgpack or JSON); 400 otherwise."""
    raw = await request.read()
    kind = request.content_type
    try:
        if kind in (MSGPACK, "application/x-msgpack"):
            body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        elif kind == "application/json" or not raw:
            body = json.loads(raw) if raw else {}
        else:
            raise HTTPError(400, "unsupported_media_type",
                            f"send application/json or {MSGPACK}, got {kind!r}")
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError) as exc:
        raise HTTPError(400, "malformed_body", f"cannot decode the {kind} body: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "malformed_body", f"the body must be an object, got "
                                               f"{type(body).__name__}")
    return body


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


def tokens_field(body: dict[str, Any], limit: int) -> Any:
    """Token ids: packed little-endian uint32 bytes, or a list of ints (validated later)."""
    tokens = field(body, "tokens", (bytes, list))
    count = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
    if count > limit:
        raise HTTPError(413, "too_many_tokens", f"{count} tokens exceed the limit of {limit}")
    return tokens


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
