"""Abuse: one abusive client against a real ``tierstore serve`` (its own process), while
another polls ``/healthz`` every ~10 ms.

Attacks (issue 19), each on a fresh service:

- ``slowloris``: two connections declare ``Content-Length: 1 GiB`` on ``batch_set`` and send
  16 bytes a second; meanwhile a 1 KiB ``batch_set`` from a third client is timed;
- ``tokens_1e7``: a 9.5 MiB msgpack body holding a 10**7-element ``tokens`` array;
- ``tokens_28mib``: the same with 3 * 10**7 elements (28.6 MiB).

Per attack: /healthz p50 / p99 / max (ms), the service's RSS growth (its peak over its
resting RSS), the attack's answer and its time. Target: /healthz p99 < 100 ms.
``--service-root DIR`` runs the service from another checkout (e.g. a ``git worktree`` of an
older commit) for a before/after run on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from tierstore.bench._util import table
from tierstore.reference_model import CONFIG
from tierstore.service.running import Served, serve_process

PAGE = 16
TARGET_P99_MS = 100.0
SLOW_BYTES = 1 << 30  # each slow sender's declared body
ATTACKS = ("slowloris", "tokens_1e7", "tokens_28mib")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attacks", default=",".join(ATTACKS),
                        help=f"comma-separated, of {', '.join(ATTACKS)}")
    parser.add_argument("--slow-seconds", type=float, default=6.0,
                        help="how long the slow senders trickle before the bench stops")
    parser.add_argument("--body-timeout", type=float, default=15.0,
                        help="the service's --body-timeout (the slow senders' 408 comes then)")
    parser.add_argument("--poll-ms", type=float, default=10.0, help="/healthz period")
    parser.add_argument("--service-root", default=None,
                        help="run the service from this checkout (PYTHONPATH, cwd)")


@contextmanager
def _serve(root: str | None, body_timeout_s: float) -> Iterator[Served]:
    """``tierstore serve`` in a child process (CPU, no L2/L3, 64 MiB storage host copy); stops
    it by its pid."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(CONFIG, f)
        env = dict(os.environ)
        if root is not None:
            env["PYTHONPATH"] = os.path.abspath(root)
        with serve_process(
                ["--model-config", path, "--page-size", str(PAGE), "--l1", "16MiB", "--l2", "0",
                 "--no-redis", "--device", "cpu", "--kv-host", "64MiB", "--no-shm",
                 "--body-timeout", str(body_timeout_s)], env=env, cwd=root) as served:
            yield served


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


class Prober:
    """Polls ``/healthz`` on one keep-alive connection every ``period_s``, and the service's
    RSS as often on a thread of its own (a stalled /healthz must not stall the sampling),
    until stopped."""

    def __init__(self, served: Served, period_s: float) -> None:
        self.served = served
        self.period_s = period_s
        self.latencies: list[float] = []
        self.peak_rss = _rss(served.pid)
        self.failures = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name="healthz-probe", daemon=True),
                         threading.Thread(target=self._sample, name="rss-probe", daemon=True)]

    def __enter__(self) -> Prober:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak_rss = max(self.peak_rss, _rss(self.served.pid))

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.served.port, timeout=120)
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                self.latencies.append(time.perf_counter() - start)
            except (OSError, http.client.HTTPException):
                self.failures += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.served.port, timeout=120)
            self._stop.wait(max(0.0, self.period_s - (time.perf_counter() - start)))
        conn.close()

    def figures(self) -> dict[str, Any]:
        ms = np.array(self.latencies) * 1e3
        return {"healthz_polls": len(ms), "healthz_failures": self.failures,
                "healthz_p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
                "healthz_p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
                "healthz_max_ms": float(ms.max()) if len(ms) else None}


@dataclass(frozen=True)
class Attack:
    """``prepare`` builds what to send (before timing starts); ``run`` sends it and waits for
    the answer, returning its figures."""

    prepare: Callable[[argparse.Namespace], Any]
    run: Callable[[Served, argparse.Namespace, Any], dict[str, Any]]


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: "
            f"application/msgpack\r\nContent-Length: {length}\r\n\r\n").encode()


def _answer(sock: socket.socket) -> tuple[int | None, str]:
    """The status and error name of the answer on ``sock`` (None: closed unanswered)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except OSError:
        pass
    head, _, body = got.partition(b"\r\n\r\n")
    if not head:
        return None, "closed"
    try:
        error = json.loads(body).get("error", "")
    except ValueError:
        error = ""
    return int(head.split()[1]), str(error)


def _post(port: int, body: bytes) -> dict[str, Any]:
    """Send ``body`` to ``/v1/insert`` at full speed; its answer and the seconds to it."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        with contextlib.suppress(OSError):  # refused mid-body: the answer may be there
            sock.sendall(_head("/v1/insert", len(body)) + body)
        status, error = _answer(sock)
    return {"status": status, "error": error, "answer_s": time.perf_counter() - start}


def _tokens_attack(count: int) -> Attack:
    def prepare(args: argparse.Namespace) -> bytes:
        return msgpack.packb({"tokens": [1] * count})

    def attack(served: Served, args: argparse.Namespace, body: Any) -> dict[str, Any]:
        return {"body_mib": len(body) / 2**20, **_post(served.port, body)}

    return Attack(prepare, attack)


def _slowloris(served: Served, args: argparse.Namespace, _: Any) -> dict[str, Any]:
    """Two 1 GiB declared bodies trickling 16 B/s (a batch_set of one 1 GiB value, whose
    bytes never end); a 1 KiB batch_set timed meanwhile."""
    socks = [socket.create_connection(("127.0.0.1", served.port), timeout=300)
             for _ in range(2)]
    start = time.perf_counter()
    fields = b"\x82\xa4keys\x91\xa1k\xa6values\x91\xc6"
    opening = fields + (SLOW_BYTES - len(fields) - 4).to_bytes(4, "big")
    try:
        for sock in socks:
            sock.sendall(_head("/v1/storage/batch_set", SLOW_BYTES) + opening)
        time.sleep(0.5)  # the service has the headers
        small = msgpack.packb({"keys": ["small"], "values": [b"v" * 1024]})
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", served.port), timeout=300) as sock:
            sock.sendall(_head("/v1/storage/batch_set", len(small)) + small)
            status, _ = _answer(sock)
        small_s = time.perf_counter() - t0
        answers: list[tuple[int | None, str]] = []
        while time.perf_counter() - start < args.slow_seconds:
            for sock in socks:
                sock.sendall(b"\x00" * 16)
            time.sleep(1.0)
        for sock in socks:  # the rest never comes: wait for the 408
            sock.settimeout(args.body_timeout + 30)
            answers.append(_answer(sock))
        return {"small_batch_set_status": status, "small_batch_set_s": small_s,
                "status": answers[0][0], "error": answers[0][1],
                "answer_s": time.perf_counter() - start}
    finally:
        for sock in socks:
            sock.close()


RUNS: dict[str, Attack] = {"slowloris": Attack(lambda args: None, _slowloris),
                           "tokens_1e7": _tokens_attack(10**7),
                           "tokens_28mib": _tokens_attack(3 * 10**7)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [n for n in args.attacks.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise SystemExit(f"unknown attacks {unknown}; choose from {', '.join(ATTACKS)}")
    out: dict[str, Any] = {"service_root": args.service_root or "this checkout",
                           "target_healthz_p99_ms": TARGET_P99_MS, "attacks": {}}
    for name in names:
        with _serve(args.service_root, args.body_timeout) as served:
            # Built before the probe starts: packing 3 * 10**7 ints holds this process's GIL
            # for a second, which the probe (a thread here) would count against the service.
            payload = RUNS[name].prepare(args)
            time.sleep(1.0)  # let the child settle before its resting RSS is read
            resting = _rss(served.pid)
            with Prober(served, args.poll_ms / 1e3) as probe:
                time.sleep(0.3)
                figures = RUNS[name].run(served, args, payload)
                time.sleep(0.3)
            row = {**figures, **probe.figures(),
                   "rss_growth_mib": (probe.peak_rss - resting) / 2**20}
            row["meets_target"] = row["healthz_p99_ms"] is not None and \
                row["healthz_p99_ms"] < TARGET_P99_MS
            out["attacks"][name] = row
    return out


def render(result: dict[str, Any]) -> str:
    rows = [{"attack": name, "answer": f"{r['status']} {r['error']}", "answer_s": r["answer_s"],
             "healthz_p50_ms": r["healthz_p50_ms"], "healthz_p99_ms": r["healthz_p99_ms"],
             "healthz_max_ms": r["healthz_max_ms"], "polls": r["healthz_polls"],
             "rss_growth_mib": r["rss_growth_mib"],
             "small_set_s": r.get("small_batch_set_s")}
            for name, r in result["attacks"].items()]
    return (f"abusive requests against `tierstore serve` ({result['service_root']}), /healthz "
            f"polled meanwhile (target p99 < {result['target_healthz_p99_ms']:.0f} ms):\n" +
            table(rows, ["attack", "answer", "answer_s", "healthz_p50_ms", "healthz_p99_ms",
                         "healthz_max_ms", "polls", "rss_growth_mib", "small_set_s"]))
