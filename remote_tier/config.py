"""``RemoteTierConfig``: every knob of the Redis tier, frozen and validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

from remote_tier.mac import check_secret
from remote_tier.wire import MAX_HEADER_BYTES

Mode = Literal["standalone", "cluster"]

_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_URL_SECRET_RE = re.compile(r"(//[^/@?#]*?:)[^/@?#]*@|([?&]password=)[^&#]*")
MAX_BULK_BYTES = 512 * 1024 * 1024  # Redis' default proto-max-bulk-len


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect: parsed from ``RemoteTierConfig.url``. ``path`` is a unix
    socket's (``host`` is then that path and ``port`` 0)."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None = field(default=None, repr=False)
    path: str | None = None


@dataclass(frozen=True)
class RemoteTierConfig:
    """Configuration of one ``RedisTier``.

    ``url`` is ``redis://[user:password@]host[:port][/db]`` or, for a unix socket (standalone
    only), ``unix://[user:password@]/path/to.sock[?db=N&password=P]``; in cluster mode it names
    any one node (a startup node) and ``db`` must be 0. TLS (``rediss://``) is not supported by
    the data path. The password never appears in ``repr``, logs or errors
    (``redacted_url``). ``op_timeout_s`` bounds a connect and, per connection, how
    long a request may make no progress (so a 4 MiB transfer is not cut short, but a silent
    server is). ``connections`` is per node. ``pipeline_bytes`` bounds the SET payload bytes in
    flight on one connection (a larger value travels alone, which Redis handles fastest).
    ``batch_keys`` bounds keys per MGET/UNLINK command and per existence-probe round.
    ``ordered_writes`` keeps a ``put_many`` batch visible strictly in the order given
    (parent first); off, items are spread over connections and nodes with no order.
    The breaker opens after ``breaker_failures`` consecutive failed calls to a node, for
    ``breaker_cooldown_s``, doubling per failed probe up to ``breaker_max_cooldown_s``.
    ``recv_pool_bytes`` bounds the receive buffers ``get_many`` keeps for reuse (0: none).

    ``chunk_bytes`` (0, or 4096 up to ``max_value_bytes`` less 256 header bytes) is how many
    payload bytes one Redis value carries: a larger payload is split into ``ceil(len /
    chunk_bytes)`` near-equal parts (at most 4096), stored at the key and at ``{key} #{i}``, so
    no single value holds Redis' one thread or one cluster slot for long; 0 never splits.
    Readers take values written with any ``chunk_bytes``; a reader with the writer's setting
    receives every part straight into the caller's buffer in one round trip.
    ``max_value_bytes`` bounds one Redis value (one part with its header).

    ``mac_key`` is the deployment secret (at least 32 bytes, shared by every instance that
    shares this L3) that values are authenticated with (``remote_tier.mac``); ``None``: this
    user's key file (``mac.user_key_file()``, created on first use). It is never printed.
    """

    url: str = "redis://127.0.0.1:6379/0"
    mode: Mode = "standalone"
    key_prefix: str = "ts"
    ttl_s: float | None = None
    max_value_bytes: int = 64 * 1024 * 1024
    op_timeout_s: float = 2.0
    connections: int = 4
    pipeline_bytes: int = 1024 * 1024
    batch_keys: int = 64
    ordered_writes: bool = True
    breaker_failures: int = 3
    breaker_cooldown_s: float = 0.5
    breaker_max_cooldown_s: float = 30.0
    recv_pool_bytes: int = 256 * 1024 * 1024
    chunk_bytes: int = 16 * 1024 * 1024
    mac_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.endpoint()  # validates the URL
        if self.mac_key is not None:
            check_secret(self.mac_key)
        if self.mode not in ("standalone", "cluster"):
            raise ValueError(f"mode must be 'standalone' or 'cluster', got {self.mode!r}")
        if self.mode == "cluster" and self.endpoint().path is not None:
            raise ValueError("a redis cluster is reached over TCP, not a unix socket")
        if self.mode == "cluster" and self.endpoint().db != 0:
            raise ValueError(f"redis cluster has only db 0, url selects db {self.endpoint().db}")
        if not _PREFIX_RE.fullmatch(self.key_prefix):
            raise ValueError(f"key_prefix must be 1-64 of [A-Za-z0-9._-], got {self.key_prefix!r}")
        if self.ttl_s is not None and not self.ttl_s >= 0.001:
            raise ValueError(f"ttl_s must be None or >= 0.001 s, got {self.ttl_s}")
        if not 1024 <= self.max_value_bytes <= MAX_BULK_BYTES:
            raise ValueError(
                f"max_value_bytes must be in [1024, {MAX_BULK_BYTES}], got {self.max_value_bytes}"
            )
        most = self.max_value_bytes - MAX_HEADER_BYTES
        if self.chunk_bytes != 0 and not 4096 <= self.chunk_bytes <= most:
            raise ValueError(
                f"chunk_bytes must be 0 or in [4096, {most}] (max_value_bytes "
                f"{self.max_value_bytes} less {MAX_HEADER_BYTES} header bytes), "
                f"got {self.chunk_bytes}"
            )
        if not self.op_timeout_s > 0:
            raise ValueError(f"op_timeout_s must be > 0, got {self.op_timeout_s}")
        if not 1 <= self.connections <= 64:
            raise ValueError(f"connections must be in [1, 64], got {self.connections}")
        if not 4096 <= self.pipeline_bytes <= MAX_BULK_BYTES:
            raise ValueError(
                f"pipeline_bytes must be in [4096, {MAX_BULK_BYTES}], got {self.pipeline_bytes}"
            )
        if not 1 <= self.batch_keys <= 10_000:
            raise ValueError(f"batch_keys must be in [1, 10000], got {self.batch_keys}")
        if not 1 <= self.breaker_failures <= 1000:
            raise ValueError(f"breaker_failures must be in [1, 1000], got {self.breaker_failures}")
        if not 0 <= self.recv_pool_bytes <= 1 << 40:
            raise ValueError(f"recv_pool_bytes must be in [0, 2**40], got {self.recv_pool_bytes}")
        if not 0 < self.breaker_cooldown_s <= self.breaker_max_cooldown_s:
            raise ValueError(
                f"need 0 < breaker_cooldown_s <= breaker_max_cooldown_s, got "
                f"{self.breaker_cooldown_s} and {self.breaker_max_cooldown_s}"
            )

    def __repr__(self) -> str:
        shown = (f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"RemoteTierConfig({', '.join(shown)})".replace(
            repr(self.url), repr(self.redacted_url), 1)

    @property
    def redacted_url(self) -> str:
        """``url`` with its password replaced by ``***`` (for logs and errors)."""
        return redact_url(self.url)

    def endpoint(self) -> Endpoint:
        """The host (or socket path), port, db and credentials named by ``url``."""
        shown = self.redacted_url
        parts = urlsplit(self.url)
        if parts.scheme == "unix":
            if parts.hostname:
                raise ValueError(f"unix url takes a path, not a host: {shown!r}")
            return _unix_endpoint(parts.path, parts.query, parts.username, parts.password, shown)
        if parts.scheme != "redis":
            raise ValueError(f"url scheme must be redis:// or unix:// (no TLS), got {shown!r}")
        try:
            port = parts.port or 6379
        except ValueError:
            raise ValueError(f"url has a bad port: {shown!r}") from None
        if not parts.hostname:
            raise ValueError(f"url has no host: {shown!r}")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise ValueError(f"url path must be a db number, got {path!r}")
        return Endpoint(
            host=parts.hostname,
            port=port,
            db=int(path) if path else 0,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
        )


def redact_url(url: str) -> str:
    """``url`` with any password (``user:password@``, ``?password=``) replaced by ``***``."""
    return _URL_SECRET_RE.sub(
        lambda m: f"{m[1]}***@" if m[1] is not None else f"{m[2]}***", url)


def _unix_endpoint(path: str, query: str, username: str | None, password: str | None,
                   shown: str) -> Endpoint:
    """A ``unix:///path?db=N&password=P&username=U`` URL's endpoint (credentials may also
    come as ``unix://user:password@/path``)."""
    if not path.startswith("/"):
        raise ValueError(f"unix url needs an absolute socket path, got {shown!r}")
    try:
        params = parse_qs(query, strict_parsing=bool(query), max_num_fields=8)
    except ValueError:
        raise ValueError(f"unix url has a bad query: {shown!r}") from None
    if unknown := set(params) - {"db", "password", "username"}:
        raise ValueError(f"unix url has unknown parameters {sorted(unknown)}: {shown!r}")
    if any(len(v) > 1 for v in params.values()):
        raise ValueError(f"unix url repeats a parameter: {shown!r}")
    db = params.get("db", ["0"])[0]
    if not db.isdigit():
        raise ValueError(f"unix url db must be a number, got {db!r}")
    password = params.get("password", [unquote(password) if password else ""])[0]
    username = params.get("username", [unquote(username) if username else ""])[0]
    return Endpoint(host=path, port=0, db=int(db), username=username or None,
                    password=password or None, path=path)
