"""Run a real tierstore service in-process on a free loopback port (demo, benchmarks, tests)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from remote_tier import RemoteTierConfig
from remote_tier.embedded import free_port
from tierstore.service.app import Service
from tierstore.service.config import ServiceConfig
from tierstore.service.http import GuardedRunner
from tierstore.store import TierStore

__all__ = ["RunningService", "free_port"]


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

    def __enter__(self) -> RunningService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
