"""Request fields and responses: typed field access, envelopes stacked for the store, msgpack
responses written in chunks. Bodies are read and decoded in :mod:`.body` (re-exported here)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from tierstore.service.body import (
    BODY_LIMITS,
    INT64_MAX,
    INT64_MIN,
    JSON_MAX_BYTES,
    MAX_DEPTH,
    MSGPACK,
    TOKEN_MAX,
    BodyBudget,
    BodyLimits,
    HTTPError,
    RouteLimits,
    check_int,
    decode_body,
    error_response,
    read_body,
    read_raw,
    release_body,
    token_array,
)

__all__ = ["BODY_LIMITS", "INT64_MAX", "INT64_MIN", "JSON_MAX_BYTES", "MAX_DEPTH", "MSGPACK",
           "TOKEN_MAX", "BodyBudget", "BodyLimits", "HTTPError", "RouteLimits", "bin_header",
           "blobs_field", "check_int", "decode_body", "error_response", "field", "int_field",
           "msgpack_chunks", "read_body", "read_raw", "release_body", "stack", "token_array",
           "tokens_field"]


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
    ``[0, 2**32)`` as a uint32 array (as ``read_body`` leaves it); 413 beyond ``limit`` ids."""
    tokens = body.get("tokens")
    if not isinstance(tokens, np.ndarray):  # read_body packs a list into an array
        tokens = field(body, "tokens", (bytes, list))
    count = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
    if count > limit:
        raise HTTPError(413, "too_many_tokens", f"{count} tokens exceed the limit of {limit}")
    if isinstance(tokens, (bytes, np.ndarray)):
        return tokens
    return token_array(tokens)


def blobs_field(body: dict[str, Any], name: str, limit: int, *, required: bool = False
                ) -> list[bytes] | None:
    """A list of byte strings (envelopes or values); 413 beyond ``limit`` items."""
    value = field(body, name, list, default=... if required else None)
    if value is None:
        return None
    if len(value) > limit:
        raise HTTPError(413, "batch_too_large", f"{len(value)} items in {name!r} exceed the "
                                                f"limit of {limit}", limit=limit)
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
