"""The keyed MAC of stored values, and the deployment secret it is keyed from.

A value is authenticated as ``(key, header, body)``: the name it is stored under, the header
fields it binds, and its payload. ``Mac.sign`` is BLAKE3 in keyed mode over the three lengths
and then the three byte strings, so no two different triples hash the same input; the body is
hashed in place (any buffer, never copied). Only someone holding the deployment secret can
make a tag that verifies: a Redis writer without it can delete values, not forge them.

The MAC key is derived from the secret with BLAKE3's key-derivation mode under ``CONTEXT``
(which names the wire version), so the secret itself never keys anything and a future format
gets an independent key from the same secret. Nothing here knows Redis: a disk tier can use
the same ``Mac`` over its slots.

Secrets come from a key file (``load_secret_file``: mode 0600 or stricter, at least
``MIN_SECRET_BYTES``) or, when a deployment names none, from this user's own key file
(``user_secret``), created on first use, so every instance run by one user on one host shares
L3 data. The secret is never logged; ``Mac`` does not print its key.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from tierstore.errors import UsageError

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

TAG_BYTES = 16  # 128-bit tags: forging one is a 2^-128 guess
MIN_SECRET_BYTES = 32
CONTEXT = "tierstore remote_tier wire v5 value MAC"  # bumped with the wire format
USER_KEY_NAME = Path("tierstore") / "mac.key"

_announced: set[Path] = set()  # key files already logged (once per process and path)


class MacKeyError(UsageError):
    """A secret or key file that cannot key the MAC (too short, unreadable, too open)."""


class Mac:
    """BLAKE3-keyed tags over ``(key, header, body)`` under a key derived from ``secret``.

    ``max_threads`` > 1 lets BLAKE3 hash one large body on several threads (it releases the
    GIL either way). Immutable and thread-safe; its repr never shows the key. A store hands
    bodies of ``offload_bytes`` or more to worker threads: a 1 MiB tag costs about as much
    CPU as moving the MiB, while a hand-off costs the event loop tens of microseconds, about
    what hashing a few tens of KiB does, so smaller bodies are hashed in place.
    """

    __slots__ = ("_key", "_threads")
    offload_bytes = 256 * 1024

    def __init__(self, secret: bytes, *, max_threads: int = 1) -> None:
        check_secret(secret)
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self._key = blake3.blake3(secret, derive_key_context=CONTEXT).digest()
        self._threads = max_threads

    def __repr__(self) -> str:
        return f"Mac(<key hidden>, max_threads={self._threads})"

    def sign(self, key: bytes, header: bytes, body: Buffer) -> bytes:
        """The ``TAG_BYTES`` tag of ``body`` (any C-contiguous buffer) stored under ``key``
        with ``header``."""
        view = memoryview(body)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")  # a flat byte view of the same memory (BLAKE3 takes u8)
        h = blake3.blake3(key=self._key, max_threads=self._threads)
        h.update(struct.pack(">QQQ", len(key), len(header), view.nbytes))
        h.update(key)
        h.update(header)
        h.update(view)
        return h.digest(TAG_BYTES)

    def verify(self, key: bytes, header: bytes, body: Buffer, tag: bytes) -> bool:
        """Whether ``tag`` is this key's tag of ``(key, header, body)`` (constant-time)."""
        return hmac.compare_digest(self.sign(key, header, body), tag)


def check_secret(secret: bytes) -> None:
    """Raise ``MacKeyError`` unless ``secret`` is bytes of at least ``MIN_SECRET_BYTES``."""
    if not isinstance(secret, bytes):
        raise MacKeyError(f"the MAC secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise MacKeyError(
            f"the MAC secret is {len(secret)} bytes; it must be at least {MIN_SECRET_BYTES} "
            f"(e.g. `head -c 32 /dev/urandom | base64 > mac.key; chmod 600 mac.key`)"
        )


def load_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The secret in the key file ``path`` (trailing newlines stripped).

    Raises ``MacKeyError`` when it is missing, not a regular file, readable or writable by
    group or others, or holds fewer than ``MIN_SECRET_BYTES`` bytes.
    """
    where = Path(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise MacKeyError(f"cannot open the MAC key file {where}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MacKeyError(f"the MAC key file {where} is not a regular file")
        if info.st_mode & 0o077:
            raise MacKeyError(
                f"the MAC key file {where} is open to group/others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); run `chmod 600 {where}`"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            secret = f.read(1 << 16).rstrip(b"\r\n")
    finally:
        os.close(fd)
    try:
        check_secret(secret)
    except MacKeyError as exc:
        raise MacKeyError(f"the MAC key file {where}: {exc}") from None
    return secret


def user_key_file(config_home: Path | None = None) -> Path:
    """This user's key file: ``$XDG_CONFIG_HOME/tierstore/mac.key`` (XDG's default
    ``~/.config`` when unset; read here, as ``Path.home`` reads ``HOME``, so that every
    caller finds the same file)."""
    if config_home is None:
        config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / USER_KEY_NAME


def user_secret(path: Path | None = None) -> bytes:
    """The secret in this user's key file (``user_key_file()`` unless ``path``), created with
    32 random bytes (mode 0600, its directory 0700) if it does not exist. Where it is gets
    logged once per process."""
    path = user_key_file() if path is None else path
    created = False
    if not path.exists():
        try:
            created = _create_key_file(path)
        except OSError as exc:
            raise MacKeyError(
                f"cannot create the MAC key file {path}: {exc.strerror}; name a key file "
                f"(--mac-key-file, TIERSTORE_MAC_KEY_FILE) or set TIERSTORE_MAC_KEY"
            ) from None
    secret = load_secret_file(path)
    if path not in _announced:
        _announced.add(path)
        log.info(
            "L3 values are authenticated with this user's MAC key %s (%s); instances that "
            "share L3 across users or hosts need the same key file",
            path, "created now" if created else "existing",
        )
    return secret


def _create_key_file(path: Path) -> bool:
    """Write a fresh secret to ``path`` unless it exists; whether this call created it.

    Written to a private temporary file and linked into place, so a concurrent reader never
    sees a half-written key, and of two instances starting at once exactly one key wins."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode() + b"\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False  # another instance created it just now: use theirs
        return True
    finally:
        tmp.unlink(missing_ok=True)
