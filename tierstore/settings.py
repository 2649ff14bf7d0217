"""The one place tierstore reads its environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from remote_tier.mac import MacKeyError, check_secret, load_secret_file, user_secret


@dataclass(frozen=True)
class Environment:
    """Settings taken from the environment (command-line flags override them)."""

    auth_token: str | None
    redis_url: str | None
    redis_server: str
    log_level: str
    mac_key_file: str | None = None
    mac_key: bytes | None = field(default=None, repr=False)
    trace_url: str | None = None  # where `--trace mooncake:NAME` downloads from (a mirror)
    cache_home: str | None = None  # XDG_CACHE_HOME: downloaded traces go under it


def environment() -> Environment:
    """Read ``TIERSTORE_AUTH_TOKEN``, ``TIERSTORE_REDIS_URL``, ``TIERSTORE_REDIS_SERVER``
    (which server binary a private L3 runs: ``auto``, ``valkey``, ``redis`` or a path),
    ``TIERSTORE_LOG_LEVEL``, ``TIERSTORE_MAC_KEY_FILE`` and ``TIERSTORE_MAC_KEY`` (the L3
    MAC secret: a key file's path, or the secret itself), ``TIERSTORE_TRACE_URL`` (a mirror
    of the public traces) and ``XDG_CACHE_HOME``."""
    secret = os.environ.get("TIERSTORE_MAC_KEY")
    return Environment(
        auth_token=os.environ.get("TIERSTORE_AUTH_TOKEN") or None,
        redis_url=os.environ.get("TIERSTORE_REDIS_URL") or None,
        redis_server=os.environ.get("TIERSTORE_REDIS_SERVER") or "auto",
        log_level=os.environ.get("TIERSTORE_LOG_LEVEL", "INFO").upper(),
        mac_key_file=os.environ.get("TIERSTORE_MAC_KEY_FILE") or None,
        mac_key=secret.encode() if secret else None,
        trace_url=os.environ.get("TIERSTORE_TRACE_URL") or None,
        cache_home=os.environ.get("XDG_CACHE_HOME") or None,
    )


def mac_secret(key_file: str | None = None, env: Environment | None = None) -> bytes:
    """The deployment secret L3 values are authenticated with: the key file ``key_file``
    (``--mac-key-file``), else ``TIERSTORE_MAC_KEY_FILE``, else ``TIERSTORE_MAC_KEY``, else
    this user's own key file (created on first use). Raises ``MacKeyError`` naming the
    source when the one chosen is unusable."""
    env = environment() if env is None else env
    path = key_file or env.mac_key_file
    if path:
        return load_secret_file(path)
    if env.mac_key is not None:
        try:
            check_secret(env.mac_key)
        except MacKeyError as exc:
            raise MacKeyError(f"TIERSTORE_MAC_KEY: {exc}") from None
        return env.mac_key
    return user_secret()


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
