"""Throwaway ``redis-server`` processes on loopback for tests and benchmarks.

``RedisServer`` starts one server on a free 127.0.0.1 port in its own temporary directory
(no persistence) and can stop, kill and restart it on the same port — only ever by the PID
it started. ``RedisCluster`` starts three such servers in cluster mode and joins them with
``redis-cli --cluster create``. ``redis_binary()`` finds the binaries, installing the
``redis-server`` package with apt when missing and running as root.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType

from tierstore.testing.apt import ProgramUnavailableError, find_or_install

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


class RedisUnavailableError(ProgramUnavailableError):
    """``redis-server`` is not installed and cannot be installed here."""


def redis_binary(name: str = "redis-server") -> str:
    """The path of ``name`` (``redis-server``, ``redis-cli``, ``redis-benchmark``); installs
    the ``redis-server`` apt package if it is missing and this process runs as root."""
    try:
        return find_or_install([name], "redis-server", timeout_s=600)
    except ProgramUnavailableError as exc:
        raise RedisUnavailableError(str(exc)) from exc


def free_port(*, with_bus: bool = False) -> int:
    """A TCP port free on loopback now (and, ``with_bus``, its cluster bus port +10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 <= 65535 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _command(port: int, *args: str, timeout: float = 1.0) -> bytes:
    """One inline command to the server at ``port``; the raw reply (small replies only)."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall((" ".join(args) + "\r\n").encode())
        data = b""
        while not data.endswith(b"\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        if data.startswith(b"$"):  # bulk reply: read to its announced length
            length = int(data[1 : data.index(b"\r\n")])
            need = data.index(b"\r\n") + 2 + length + 2
            while len(data) < need:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        return data


class RedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:port``."""

    def __init__(self, *, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        self._auto_port = port is None
        self.port = port or free_port(with_bus="--cluster-enabled" in extra_args)
        self._extra_args = list(extra_args)
        self._dir = tempfile.mkdtemp(prefix=f"tierstore-redis-{self.port}-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:port/0``."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's PID while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, *, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers ``PING`` as our own process (another
        program may have taken a free port meanwhile: then, if the port was chosen here,
        retry on a new one)."""
        if self.pid is not None:
            return self
        for _ in range(5):
            if self._spawn(timeout_s):
                return self
            if not self._auto_port:
                break
            self.port = free_port(with_bus="--cluster-enabled" in self._extra_args)
        raise RuntimeError(f"redis-server could not start on port {self.port}: {self.log()}")

    def _spawn(self, timeout_s: float) -> bool:
        args = [
            redis_binary(),
            "--port", str(self.port),
            "--bind", HOST,
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--protected-mode", "no",
            *self._extra_args,
        ]  # fmt: skip
        log_file = open(os.path.join(self._dir, "redis.log"), "ab")  # noqa: SIM115
        try:
            proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
        finally:
            log_file.close()
        self._proc = proc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._proc = None
                return False
            try:
                info = _command(self.port, "INFO", "server", timeout=0.5)
                if f"process_id:{proc.pid}\r".encode() in info:
                    return True
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout_s} s")

    def command(self, *args: str) -> bytes:
        """Send one inline command (small arguments only); the raw reply."""
        return _command(self.port, *args)

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """Stop the server with SIGTERM (SIGKILL if it lingers)."""
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would."""
        self._signal(signal.SIGKILL, 5.0)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing is answered."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze a paused server (SIGCONT)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Kill if running, then start again on the same port (empty: no persistence)."""
        self.kill()
        return self.start()

    def log(self) -> str:
        """The tail of the server's log."""
        try:
            with open(os.path.join(self._dir, "redis.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _signal(self, sig: int, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)  # a paused server must run to act on SIGTERM
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RedisCluster:
    """Three cluster-mode ``redis-server`` nodes on loopback joined into one cluster (no
    replicas); ``url`` names the first node."""

    def __init__(self, num_nodes: int = 3) -> None:
        if num_nodes < 3:
            raise ValueError(f"a redis cluster needs at least 3 primaries, got {num_nodes}")
        self.nodes: list[RedisServer] = []
        self._num_nodes = num_nodes

    @property
    def url(self) -> str:
        """A startup node's URL."""
        return self.nodes[0].url

    def start(self, *, timeout_s: float = 30.0) -> RedisCluster:
        """Start the nodes, create the cluster and wait for ``cluster_state:ok`` everywhere."""
        try:
            for _ in range(self._num_nodes):
                args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
                args += ["--cluster-node-timeout", "2000"]
                node = RedisServer(extra_args=args)
                self.nodes.append(node.start())
            create = [redis_binary("redis-cli"), "--cluster", "create"]
            create += [f"{HOST}:{n.port}" for n in self.nodes]
            create += ["--cluster-replicas", "0", "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, timeout=timeout_s, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]!r}")
            deadline = time.monotonic() + timeout_s
            while not all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.nodes:
            node.close()
        self.nodes = []

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
