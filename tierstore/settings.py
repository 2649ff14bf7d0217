"""The one place tierstore reads its environment."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Environment:
    """Settings taken from the environment (command-line flags override them)."""

    auth_token: str | None
    redis_url: str | None
    redis_server: str
    log_level: str


def environment() -> Environment:
    """Read ``TIERSTORE_AUTH_TOKEN``, ``TIERSTORE_REDIS_URL``, ``TIERSTORE_REDIS_SERVER``
    (which server binary a private L3 runs: ``auto``, ``valkey``, ``redis`` or a path) and
    ``TIERSTORE_LOG_LEVEL``."""
    return Environment(
        auth_token=os.environ.get("TIERSTORE_AUTH_TOKEN") or None,
        redis_url=os.environ.get("TIERSTORE_REDIS_URL") or None,
        redis_server=os.environ.get("TIERSTORE_REDIS_SERVER") or "auto",
        log_level=os.environ.get("TIERSTORE_LOG_LEVEL", "INFO").upper(),
    )


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from ``"512MiB"``, ``"2G"``, ``"4096"`` (binary units); ValueError otherwise."""
    if isinstance(text, int):
        return text
    raw = text.strip().lower().replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if not number or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 2GiB, 1048576)")
    return int(float(number) * _UNITS[unit])
