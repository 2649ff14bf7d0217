"""``--trace mooncake:NAME``: the public traces are downloaded into the cache directory once,
kept only when they match the pinned checksum, and a host that cannot be reached is a clear
message. Every download here comes from a server on loopback: tests never touch the network."""

from __future__ import annotations

import hashlib
import http.server
import socket
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from tierstore.cli import main as cli_main
from tierstore.replay import download
from tierstore.replay.download import (
    TraceChecksumError,
    TraceDownloadError,
    TraceOffline,
    fetch_trace,
    trace_name,
)
from tierstore.replay.synth import SynthSpec, synthesize, to_jsonl
from tierstore.replay.trace import TraceError, parse_trace


class _Files(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; counts GETs."""

    gets: list[str]

    def do_GET(self) -> None:
        self.gets.append(self.path)
        super().do_GET()

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """(base URL, served folder, GET paths) of a file server on 127.0.0.1."""
    root = tmp_path / "served"
    root.mkdir()
    gets: list[str] = []
    handler = type("Handler", (_Files,), {"gets": gets})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/traces", root, gets
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _publish(root: Path, monkeypatch: pytest.MonkeyPatch, name: str = "synthetic",
             pin: bool = True) -> bytes:
    """Serve a trace as ``traces/{name}_trace.jsonl`` and (``pin``) pin its checksum."""
    body = to_jsonl(synthesize(SynthSpec(requests=40, seed=5))).encode()
    (root / "traces").mkdir(exist_ok=True)
    (root / "traces" / f"{name}_trace.jsonl").write_bytes(body)
    if pin:
        monkeypatch.setitem(download.MOONCAKE_TRACES, name, hashlib.sha256(body).hexdigest())
    return body


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_download_once_into_the_cache(mirror: tuple[str, Path, list[str]],
                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url, root, gets = mirror
    body = _publish(root, monkeypatch)
    cache = tmp_path / "cache"
    path = fetch_trace("synthetic", base_url=url, cache=cache)
    assert path == cache / "synthetic_trace.jsonl" and path.read_bytes() == body
    assert gets == ["/traces/synthetic_trace.jsonl"]
    assert len(parse_trace(path.read_text().splitlines())) == 40
    assert fetch_trace("synthetic", base_url=url, cache=cache) == path
    assert len(gets) == 1  # the checked cached copy is used
    path.write_bytes(body[:-10])  # a damaged copy is fetched again
    assert fetch_trace("synthetic", base_url=url, cache=cache).read_bytes() == body
    assert len(gets) == 2
    assert sorted(p.name for p in cache.iterdir()) == ["synthetic_trace.jsonl"]


def test_the_cache_follows_xdg_and_the_mirror_its_variable(
        mirror: tuple[str, Path, list[str]], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    url, root, gets = mirror
    _publish(root, monkeypatch, "toolagent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TIERSTORE_TRACE_URL", url)
    assert download.cache_dir() == tmp_path / "xdg" / "tierstore" / "traces"
    assert fetch_trace("toolagent") == tmp_path / "xdg/tierstore/traces/toolagent_trace.jsonl"
    assert gets == ["/traces/toolagent_trace.jsonl"]


def test_a_checksum_mismatch_keeps_nothing(mirror: tuple[str, Path, list[str]],
                                           monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    url, root, _ = mirror
    _publish(root, monkeypatch, pin=False)  # served, but the pin is the real file's
    cache = tmp_path / "cache"
    with pytest.raises(TraceChecksumError, match="expected bd070915"):
        fetch_trace("synthetic", base_url=url, cache=cache)
    assert list(cache.iterdir()) == []  # no partial file, no wrong file


def test_http_errors_and_oversized_bodies(mirror: tuple[str, Path, list[str]],
                                          monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    url, root, _ = mirror
    cache = tmp_path / "cache"
    with pytest.raises(TraceDownloadError, match="HTTP 404"):
        fetch_trace("conversation", base_url=url, cache=cache)
    body = _publish(root, monkeypatch)
    monkeypatch.setattr(download, "MAX_BYTES", len(body) // 2)
    with pytest.raises(TraceDownloadError, match="larger than"):
        fetch_trace("synthetic", base_url=url, cache=cache)
    assert list(cache.iterdir()) == []


def test_an_unreachable_host_says_so(tmp_path: Path) -> None:
    with pytest.raises(TraceOffline, match="no network"):
        fetch_trace("synthetic", base_url=f"http://127.0.0.1:{_closed_port()}",
                    cache=tmp_path, timeout_s=5)
    assert issubclass(TraceOffline, TraceDownloadError)


def test_trace_names() -> None:
    assert trace_name("mooncake:conversation") == "conversation"
    assert trace_name("traces/my.jsonl") is None
    with pytest.raises(TraceError, match="mooncake:toolagent"):
        trace_name("mooncake:chat")


def test_the_commands_exit_2_with_a_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TIERSTORE_TRACE_URL", f"http://127.0.0.1:{_closed_port()}")
    assert cli_main(["trace", "fetch", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierstore trace fetch: cannot reach") and "Traceback" not in err
    for trace in ("mooncake:conversation", "mooncake:chat", str(tmp_path / "absent.jsonl")):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["bench", "replay", "--trace", trace, "--configs", "f", "--no-progress"])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.startswith("bench replay: ")


def test_bench_replay_of_a_downloaded_trace(mirror: tuple[str, Path, list[str]],
                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    url, root, gets = mirror
    _publish(root, monkeypatch, "conversation")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TIERSTORE_TRACE_URL", url)
    assert cli_main(["bench", "replay", "--trace", "mooncake:conversation", "--configs", "f",
                     "--no-progress", "--json"]) == 0
    assert '"trace": "mooncake:conversation"' in capsys.readouterr().out.splitlines()[-1]
    assert gets == ["/traces/conversation_trace.jsonl"]
