"""The public FAST'25 Mooncake traces, downloaded on demand: ``--trace mooncake:NAME``.

Files come from the kvcache-ai/Mooncake repository at a pinned commit (or a mirror given by
``TIERSTORE_TRACE_URL``) into ``$XDG_CACHE_HOME/tierstore/traces`` (``~/.cache`` without it).
Each is checked against a pinned SHA-256 while it arrives, and kept only when it matches; a
cached copy is checked again before use. No network, an HTTP error, a wrong checksum or an
oversized body raise a :class:`TraceDownloadError` saying what to do instead.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO

from tierstore.errors import UnavailableError
from tierstore.replay.trace import TraceError
from tierstore.settings import environment

log = logging.getLogger(__name__)

MOONCAKE_COMMIT = "0d1a8040faebb7c127c8901840a38c2ff57e80c5"
MOONCAKE_URL = (f"https://raw.githubusercontent.com/kvcache-ai/Mooncake/{MOONCAKE_COMMIT}/"
                "FAST25-release/traces")
# SHA-256 of each file at that commit. synthetic: computed here from a verbatim copy (same
# length and content as the repository's); conversation and toolagent: as pinned by two
# independent public projects that download them (this machine could not reach GitHub).
MOONCAKE_TRACES = {
    "conversation": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
    "toolagent": "48a2db1a13d3bc05e6330140c64f604ba366df20d3c9e128b5c35a01c1fa5f71",
    "synthetic": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
}
PREFIX = "mooncake:"
MAX_BYTES = 256 << 20  # the largest of the three is a few MiB
_CHUNK = 1 << 16


class TraceDownloadError(UnavailableError):
    """A public trace could not be had: no network, an HTTP error, a wrong checksum or an
    oversized body. Nothing was kept."""


class TraceOffline(TraceDownloadError):
    """The trace's host could not be reached (no network, DNS, refused, timed out)."""


class TraceChecksumError(TraceDownloadError):
    """The downloaded bytes are not the pinned file."""


def cache_dir() -> Path:
    """Where downloaded traces live: ``$XDG_CACHE_HOME/tierstore/traces``."""
    home = environment().cache_home
    return (Path(home) if home else Path.home() / ".cache") / "tierstore" / "traces"


def trace_name(spec: str) -> str | None:
    """``NAME`` of a ``mooncake:NAME`` trace argument (TraceError for an unknown one), or
    None for anything else (a path)."""
    if not spec.startswith(PREFIX):
        return None
    name = spec[len(PREFIX):]
    if name not in MOONCAKE_TRACES:
        raise TraceError(f"--trace {spec!r}: the public traces are "
                         f"{', '.join(PREFIX + n for n in MOONCAKE_TRACES)}")
    return name


def fetch_trace(name: str, *, base_url: str | None = None, cache: Path | None = None,
                timeout_s: float = 30.0) -> Path:
    """The path of the checked local copy of the public trace ``name``, downloading it into
    ``cache`` (default :func:`cache_dir`) from ``base_url`` (default ``TIERSTORE_TRACE_URL``,
    else GitHub at the pinned commit) when there is no good copy yet."""
    if name not in MOONCAKE_TRACES:
        raise TraceError(f"no public trace {name!r}; there are {sorted(MOONCAKE_TRACES)}")
    expected = MOONCAKE_TRACES[name]
    cache = cache_dir() if cache is None else cache
    path = cache / f"{name}_trace.jsonl"
    if path.is_file():
        if _sha256(path) == expected:
            return path
        log.warning("cached %s does not match its checksum; downloading it again", path)
    base = base_url or environment().trace_url or MOONCAKE_URL
    url = f"{base.rstrip('/')}/{name}_trace.jsonl"
    hint = (f"download it yourself (sha256 {expected}) and pass --trace PATH, or set "
            "TIERSTORE_TRACE_URL to a mirror")
    cache.mkdir(parents=True, exist_ok=True)
    fd, part = tempfile.mkstemp(prefix=f".{name}-", suffix=".part", dir=cache)
    try:
        with os.fdopen(fd, "wb") as out:
            got = _download(url, out, timeout_s, hint)
        if got != expected:
            raise TraceChecksumError(f"{url}: sha256 {got}, expected {expected}; nothing "
                                     f"was kept. {hint}")
        os.replace(part, path)
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise
    log.info("downloaded %s to %s", url, path)
    return path


def _download(url: str, out: BinaryIO, timeout_s: float, hint: str) -> str:
    """Stream ``url`` into ``out``; its SHA-256. The size limit holds while bytes arrive."""
    digest = hashlib.sha256()
    received = 0
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            while chunk := response.read(_CHUNK):
                received += len(chunk)
                if received > MAX_BYTES:
                    raise TraceDownloadError(f"{url}: larger than {MAX_BYTES} bytes; "
                                             f"nothing was kept. {hint}")
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        raise TraceDownloadError(f"{url}: HTTP {exc.code} {exc.reason}. {hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TraceOffline(f"cannot reach {url} ({reason}): no network? {hint}") from None
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``tierstore trace fetch``'s arguments."""
    parser.add_argument("name", choices=sorted(MOONCAKE_TRACES),
                        help="which FAST'25 trace (conversation, toolagent, synthetic)")
    parser.add_argument("--base-url", default=None,
                        help="download from this mirror (default: TIERSTORE_TRACE_URL, else "
                             "GitHub at the pinned commit)")


def main(args: argparse.Namespace) -> int:
    """Download (or find cached) one public trace and print its path; exit code 2 with a
    message, no traceback, when it cannot be had."""
    try:
        print(fetch_trace(args.name, base_url=args.base_url))
    except TraceDownloadError as exc:
        print(f"tierstore trace fetch: {exc}", file=sys.stderr)
        return 2
    return 0
