"""Who may do what: tokens (stored hashed) mapped to tenants, each with namespaces and quotas.

A principals file (TOML or JSON) lists tenants::

    [tenants.alpha]
    tokens = ["sha256:9f86d08..."]      # sha256 hex of each bearer token, never the token
    namespaces = ["chat", "alpha/*"]    # exact names; a trailing * makes a prefix
    read_only = false
    max_value_bytes = "1GiB"            # storage-API values held in L2/L3 (own oldest go first)
    max_prefix_pages = 100000           # inserted prefix pages still cached (429 beyond)
    max_reserved_bytes = "64MiB"        # outstanding shared-memory reservations
    max_reservations = 16

Without a file the service has one principal (its ``--auth-token``, or each client address
without one) of the *open* tenant: every namespace, no quotas, keys as before tenants existed.
A malformed file raises :class:`PrincipalsError` naming the tenant and field.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from tierstore.errors import UsageError
from tierstore.settings import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: TOML through tomli when installed, else JSON files only
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

TOKEN_BYTES = 32  # a generated token's random bytes (256 bits)
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HASH = re.compile(r"sha256:[0-9a-f]{64}")
# What one namespace entry may hold: a namespace, or a namespace prefix followed by ``*``.
_PATTERN = re.compile(r"[A-Za-z0-9._:@/-]{0,128}\*?")
_FIELDS = {"tokens", "namespaces", "read_only", "max_value_bytes", "max_prefix_pages",
           "max_reserved_bytes", "max_reservations"}


class PrincipalsError(UsageError):
    """The principals file is missing, unreadable or malformed (the message says where)."""


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, the namespaces it may use, its quotas (None: unlimited) and
    whether it may write. The *open* tenant (``name`` empty) may use every namespace."""

    name: str
    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    read_only: bool = False
    max_value_bytes: int | None = None
    max_prefix_pages: int | None = None
    max_reserved_bytes: int | None = None
    max_reservations: int | None = None

    @property
    def is_open(self) -> bool:
        """The tenant of a service without a principals file."""
        return not self.name

    def may_use(self, namespace: str) -> bool:
        """Whether requests of this tenant may name ``namespace``."""
        if self.is_open or namespace in self.exact:
            return True
        return any(namespace.startswith(p) for p in self.prefixes)


OPEN = Tenant("")


@dataclass(frozen=True)
class Principal:
    """Who is asking: ``id`` owns leases and reservations; ``tenant`` scopes data."""

    id: str
    tenant: Tenant


def hash_token(token: str) -> str:
    """The form a token is stored in: ``sha256:<hex of the token's UTF-8 bytes>``."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def new_token() -> str:
    """A fresh random bearer token (URL-safe, 256 bits)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


class Principals:
    """Token hashes -> tenants, from a principals file (or built in tests)."""

    def __init__(self, tenants: list[tuple[Tenant, list[str]]]) -> None:
        self.tenants = {t.name: t for t, _ in tenants}
        # (digest bytes, tenant): looked up by comparing every digest in constant time.
        self._entries = [(bytes.fromhex(h.removeprefix("sha256:")), t)
                         for t, hashes in tenants for h in hashes]

    def __len__(self) -> int:
        return len(self.tenants)

    def lookup(self, token: bytes) -> Tenant | None:
        """The tenant whose token hashes to ``token``'s digest, or None. Every entry is
        compared (no early exit) with ``hmac.compare_digest``."""
        digest = hashlib.sha256(token).digest()
        found: Tenant | None = None
        for known, tenant in self._entries:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    @classmethod
    def load(cls, path: str | Path) -> Principals:
        """Read and validate a TOML (``.toml``) or JSON file; PrincipalsError when it is
        unreadable or malformed."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PrincipalsError(f"principals file {str(path)!r}: {exc}") from None
        if path.suffix != ".json" and tomllib is None:
            raise PrincipalsError(f"principals file {str(path)!r}: reading TOML needs Python "
                                  f"3.11+ or the tomli package; give a .json file instead")
        try:
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except ValueError as exc:  # TOMLDecodeError is a ValueError
            raise PrincipalsError(f"principals file {str(path)!r} is not valid "
                                  f"{'JSON' if path.suffix == '.json' else 'TOML'}: {exc}") \
                from None
        return cls.parse(data, where=str(path))

    @classmethod
    def parse(cls, data: object, *, where: str = "principals") -> Principals:
        """Validate a decoded principals document; PrincipalsError naming what is wrong."""
        if not isinstance(data, dict) or set(data) != {"tenants"} or \
                not isinstance(data["tenants"], dict) or not data["tenants"]:
            raise PrincipalsError(f"{where}: expected one table 'tenants' of one or more "
                                  f"tenants (e.g. [tenants.alpha])")
        tenants: list[tuple[Tenant, list[str]]] = []
        seen: dict[str, str] = {}
        for name, spec in data["tenants"].items():
            tenant, hashes = _tenant(name, spec, f"{where}: tenant {name!r}")
            for h in hashes:
                if h in seen:
                    raise PrincipalsError(f"{where}: tenants {seen[h]!r} and {name!r} share a "
                                          f"token hash ({h[:19]}...)")
                seen[h] = name
            tenants.append((tenant, hashes))
        return cls(tenants)


def _tenant(name: object, spec: object, where: str) -> tuple[Tenant, list[str]]:
    if not isinstance(name, str) or not _TENANT.fullmatch(name):
        raise PrincipalsError(f"{where}: a tenant name is 1-64 characters of "
                              f"[A-Za-z0-9._-] starting with a letter or digit")
    if not isinstance(spec, dict):
        raise PrincipalsError(f"{where}: expected a table of fields")
    unknown = set(spec) - _FIELDS
    if unknown:
        raise PrincipalsError(f"{where}: unknown field(s) {sorted(unknown)} (known: "
                              f"{sorted(_FIELDS)})")
    hashes = spec.get("tokens")
    if not isinstance(hashes, list) or not hashes or \
            not all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes):
        raise PrincipalsError(f"{where}: 'tokens' must be a non-empty list of "
                              f"'sha256:<64 lowercase hex>' token hashes (`tierstore "
                              f"principals token` prints one); tokens are never stored")
    patterns = spec.get("namespaces")
    if not isinstance(patterns, list) or not patterns or \
            not all(isinstance(p, str) and p and _PATTERN.fullmatch(p) for p in patterns):
        raise PrincipalsError(f"{where}: 'namespaces' must be a non-empty list of namespace "
                              f"names, each optionally ending in * (a prefix)")
    read_only = spec.get("read_only", False)
    if not isinstance(read_only, bool):
        raise PrincipalsError(f"{where}: 'read_only' must be true or false")
    quotas = {k: _quota(spec.get(k), k, where, size=k.endswith("bytes"))
              for k in ("max_value_bytes", "max_prefix_pages", "max_reserved_bytes",
                        "max_reservations")}
    tenant = Tenant(name, frozenset(p for p in patterns if not p.endswith("*")),
                    tuple(p[:-1] for p in patterns if p.endswith("*")), read_only, **quotas)
    return tenant, list(hashes)


def _quota(value: object, key: str, where: str, *, size: bool) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or \
            (isinstance(value, str) and not size):
        raise PrincipalsError(f"{where}: {key!r} must be a non-negative integer"
                              + (" or a size such as '64MiB'" if size else ""))
    try:
        number = parse_size(value) if size else int(value)
    except ValueError as exc:
        raise PrincipalsError(f"{where}: {key!r}: {exc}") from None
    if number < 0:
        raise PrincipalsError(f"{where}: {key!r} must not be negative, got {number}")
    return number


def cli(command: str, path: str | None = None) -> int:
    """``tierstore principals token|hash|check``: print a new token and the line that goes in
    the file (the token itself never does), hash a token read from stdin, or validate a file."""
    if command == "check":
        assert path is not None
        try:
            loaded = Principals.load(path)
        except PrincipalsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{path}: {len(loaded)} tenants: {', '.join(sorted(loaded.tenants))}")
        return 0
    if command == "token":
        token = new_token()
        print(f"token (give it to the client; it is not stored): {token}")
    else:
        token = sys.stdin.readline().strip()
        if not token:
            print("error: no token on stdin", file=sys.stderr)
            return 1
    print(f'tokens = ["{hash_token(token)}"]')
    return 0
