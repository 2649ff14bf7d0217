"""Run a real tierstore service on a free loopback port: in-process (demo, benchmarks, tests) or
as a ``tierstore serve`` child process (benchmarks that must not share its interpreter)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from aiohttp import web

from remote_tier import RemoteTierConfig
from remote_tier.embedded import free_port
from tierstore.service.app import Service
from tierstore.service.config import ServiceConfig
from tierstore.service.http import GuardedRunner
from tierstore.store import TierStore

__all__ = ["RunningService", "Served", "free_port", "serve_process"]


class RunningService:
    """``with RunningService(store) as svc: svc.url`` — the app on its own event-loop thread;
    leaving closes the service and the store."""

    def __init__(self, store: TierStore, config: ServiceConfig | None = None,
                 kv_remote: RemoteTierConfig | None = None) -> None:
        self.config = config or ServiceConfig(port=free_port(), kv_host_bytes=16 << 20)
        if self.config.port == 0:
            raise ValueError("give RunningService a concrete port (free_port())")
        self.service = Service(store, self.config, kv_remote)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierstore-svc",
                                        daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> RunningService:
        self._thread.start()

        async def up() -> web.AppRunner:
            runner = GuardedRunner(self.service.app(), self.config, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.config.port).start()
            return runner

        self._runner = asyncio.run_coroutine_threadsafe(up(), self._loop).result(30)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()  # its selector and wake-up pipe

    def __enter__(self) -> RunningService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Served:
    """A running ``tierstore serve`` child process: its URL, port and process id."""

    url: str
    port: int
    pid: int

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the process has used so far (Linux ``/proc``)."""
        with open(f"/proc/{self.pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def serve_process(flags: list[str], *, env: dict[str, str] | None = None,
                  cwd: str | None = None, start_timeout_s: float = 120) -> Iterator[Served]:
    """``tierstore serve FLAGS --port P`` in a child process on a free loopback port; yields it
    once ``/healthz`` answers, and stops it by its pid on exit (SIGTERM, then SIGKILL)."""
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "tierstore.cli", "serve", *flags, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(url):
            if child.poll() is not None or time.monotonic() > deadline:
                err = child.stderr.read().decode(errors="replace") if child.stderr else ""
                raise RuntimeError(f"tierstore serve did not come up: {err[-2000:]}")
            time.sleep(0.1)
        yield Served(url, port, child.pid)
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False
