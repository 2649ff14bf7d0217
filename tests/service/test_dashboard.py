"""The live dashboard in a real headless Chromium: after a scripted workload through the HTTP
API, the page's numbers, chart series and arena bars match ``/v1/stats``.

Chromium comes from ``TIERSTORE_CHROMIUM`` or PATH, or is installed with apt when running as root
(CI); otherwise the browser tests skip with a message saying how to enable them."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from tierstore.config import StoreConfig
from tierstore.service.config import ServiceConfig
from tierstore.store import TierStore
from tierstore.testing.apt import ProgramUnavailableError, find_or_install
from tierstore.testing.reference_model import tiny_layout
from tierstore.testing.service import RunningService, free_port

LAYOUT = tiny_layout(page_size=4)
UNITS = {k: e.nbytes for k, e in LAYOUT.envelopes().items()}
TOKEN = "dash-token"
PAGES = 4  # per prompt
PROMPTS = 14  # about 135 KiB of envelopes: more than L1 holds, so early prompts go to L2
DIRECTIONS = ("l1_to_l2", "l1_to_l3", "l2_to_l3", "l2_to_l1", "l3_to_l1", "l3_to_l2")


# ---------------------------------------------------------------------------- Chromium
@pytest.fixture(scope="module")
def chromium() -> str:
    """``TIERSTORE_CHROMIUM``, else Chromium or Chrome on PATH, else Debian's ``chromium``
    installed with apt (root only, as on CI); otherwise the browser tests skip, saying how to
    enable them."""
    if named := os.environ.get("TIERSTORE_CHROMIUM"):
        if path := shutil.which(named):
            return path
        pytest.fail(f"TIERSTORE_CHROMIUM={named!r} is not an executable")
    try:
        return find_or_install(["chromium", "chromium-browser", "google-chrome"], "chromium")
    except ProgramUnavailableError as exc:
        pytest.skip(f"dashboard browser tests: {exc}; or set TIERSTORE_CHROMIUM=/path/to/chrome")


def browse(binary: str, url: str, tmp: Path, *, screenshot: Path | None = None) -> str:
    """Load ``url`` headless for 5 s of virtual time (the page polls ~5 times); the final DOM,
    or a screenshot when ``screenshot`` is given."""
    out = ["--screenshot=" + str(screenshot), "--window-size=1400,1500"] if screenshot else [
        "--dump-dom"]
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={tmp / 'profile'}",
           "--virtual-time-budget=5000", *out, url]
    done = subprocess.run(cmd, capture_output=True, timeout=60, cwd=tmp)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return done.stdout.decode()


class Page(HTMLParser):
    """The dumped DOM's readable parts: data-metric values, chart paths, bar rects."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.metrics: dict[str, str] = {}
        self.text: dict[str, str] = {}
        self.paths: dict[tuple[str, str], dict[str, str]] = {}
        self.rects: dict[str, list[dict[str, str]]] = {}
        self.body: dict[str, str] = {}
        self.status: dict[str, str] = {}
        self._svg: str | None = None
        self._capture: str | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "svg":
            self._svg = a.get("id", "")
        elif tag == "path" and self._svg and "data-series" in a:
            self.paths[(self._svg, a["data-series"])] = a
        elif tag == "rect" and self._svg:
            self.rects.setdefault(self._svg, []).append(a)
        if a.get("id") == "status":
            self.status, self._capture = a, "#status"
        elif "data-metric" in a and a["data-metric"] not in self.metrics:
            self.metrics[a["data-metric"]] = a.get("data-value", "")
            self._capture = a["data-metric"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._svg = None
        self._capture = None

    def handle_data(self, data: str) -> None:
        if self._capture is not None:
            self.text[self._capture] = self.text.get(self._capture, "") + data

    def number(self, name: str) -> float:
        assert name in self.metrics, f"the page has no data-metric={name!r}"
        assert self.metrics[name] != "", f"data-metric={name!r} was never filled in"
        return float(self.metrics[name])


# ---------------------------------------------------------------------------- service
def request(url: str, path: str, body: dict[str, Any] | None = None,
            token: str | None = None) -> tuple[int, Any]:
    data = None if body is None else msgpack.packb(body, use_bin_type=True)
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST")
    if body is not None:
        req.add_header("Content-Type", "application/msgpack")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as res:
            status, raw = res.status, res.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def workload(url: str, token: str | None) -> None:
    """Insert PROMPTS prompts (L1 overflows into L2), then match them again: the recent ones
    hit L1, the early ones are promoted from L2, and unknown prompts miss."""
    g = torch.Generator().manual_seed(0)

    def blobs(kind: str, n: int) -> list[bytes]:
        return [torch.randint(0, 256, (UNITS[kind],), dtype=torch.uint8, generator=g)
                .numpy().tobytes() for _ in range(n)]

    def prompt(i: int) -> list[int]:
        return list(range(1000 * i, 1000 * i + PAGES * LAYOUT.page_size))

    for i in range(PROMPTS):
        body = {"tokens": prompt(i), "kv": blobs("kv", PAGES), "swa": blobs("swa", 2),
                "state": blobs("state", 1)[0]}
        status, answer = request(url, "/v1/insert", body, token)
        assert status == 200 and answer["stored"], answer
    for i in [*range(PROMPTS - 1, PROMPTS - 4, -1), 0, 1, 2, 50, 51]:
        status, answer = request(url, "/v1/match", {"tokens": [*prompt(i), 7, 7]}, token)
        assert status == 200, answer


def stats(url: str, token: str | None = None) -> dict[str, Any]:
    status, body = request(url, "/v1/stats", token=token)
    assert status == 200, body
    return body


def store_part(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("service", "time")}


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """A service (with the auth token when parametrized so) after the workload, and its stats."""
    token = getattr(request, "param", None)
    store = TierStore(LAYOUT, StoreConfig(capacity_bytes=64 << 10, host_capacity_bytes=1 << 20))
    config = ServiceConfig(port=free_port(), auth_token=token, max_body_bytes=4 << 20,
                           kv_host_bytes=1 << 20)
    with RunningService(store, config) as svc:
        workload(svc.url, token)
        yield svc.url, token, stats(svc.url, token)


# ---------------------------------------------------------------------------- tests
def test_page_is_self_contained() -> None:
    html = resources.files("tierstore.service").joinpath("static/dashboard.html").read_text()
    external = re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|@import|url\(\s*["']?"""
                          r"""(?:https?:)?//""", html)
    assert not external, f"the dashboard must work offline; it loads {external}"
    assert "<script src" not in html
    assert re.findall(r"<link[^>]*>", html) == ['<link rel="icon" href="data:,">']


def check_page(page: Page, expected: dict[str, Any]) -> None:
    """Every number the page shows agrees with ``expected`` (a /v1/stats body)."""
    assert page.status.get("data-state") == "ok", page.text.get("#status")
    assert int(page.body["data-polls"]) >= 2, "the page should have polled repeatedly"
    assert page.number("hit_rate") == pytest.approx(expected["hit_rate"])
    assert page.text["hit_rate"] == f"{100 * expected['hit_rate']:.1f} %"
    for name in ("requests", "requests_hit", "tokens_queried", "tokens_hit", "evictions",
                 "pages", "nodes"):
        assert page.number(name) == expected[name], name
    assert page.text["requests"] == f"{expected['requests']:,}"
    queried = expected["tokens_queried"]
    served = {**expected["hit_tokens"], "miss": queried - expected["tokens_hit"]}
    for tier, tokens in served.items():
        assert page.number(f"hit_tokens.{tier}") == tokens, tier
        assert page.number(f"share.{tier}") == pytest.approx(tokens / queried)
        assert page.number(f"hit_requests.{tier}") == expected["hit_requests"][tier]
        # The chart's first point covers everything since start; later polls saw no queries.
        path = page.paths[("chart-hits", tier)]
        assert float(path["data-first"]) == pytest.approx(tokens / queried), tier
        assert path["data-points"] == "1"
    rate = page.paths[("chart-hits", "hit_rate")]
    assert float(rate["data-last"]) == pytest.approx(expected["hit_rate"])
    assert int(rate["data-points"]) == int(page.body["data-polls"])
    for direction in DIRECTIONS:
        assert page.number(f"moved_bytes.{direction}") == expected["moved_bytes"][direction]
        assert page.number(f"moved_rate.{direction}") == 0.0  # no traffic while polling
        assert int(page.paths[("chart-moves", direction)]["data-points"]) >= 1
    for kind, n in expected["evicted_blocks"].items():
        assert page.number(f"evicted_blocks.{kind}") == n
    check_outcomes(page, expected)
    for tier, arena in (("l1", expected["arena"]), ("l2", expected["host"])):
        assert page.number(f"arena.{tier}.capacity_bytes") == arena["capacity_bytes"]
        assert page.number(f"arena.{tier}.gap_bytes") == arena["gap_bytes"]
        bands = {r["data-pool"]: r for r in page.rects[f"bar-{tier}"]
                 if "data-start" in r}
        assert set(bands) == set(arena["pools"])
        for pool, p in arena["pools"].items():
            for name in ("live_bytes", "live_blocks", "hole_bytes", "pending_bytes"):
                assert page.number(f"arena.{tier}.{pool}.{name}") == p[name], (tier, pool)
            rect = bands[pool]
            assert (int(rect["data-start"]), int(rect["data-end"])) == (p["band_start"],
                                                                       p["band_end"])
            scale = 1000 / arena["capacity_bytes"]
            assert float(rect["x"]) == pytest.approx(p["band_start"] * scale, abs=1e-6)
            assert float(rect["width"]) == pytest.approx(
                (p["band_end"] - p["band_start"]) * scale, abs=1e-6)
            live = [r for r in page.rects[f"bar-{tier}"]
                    if r.get("data-pool") == pool and r.get("data-part") == "live"]
            assert bool(live) == (p["live_bytes"] > 0)


def check_outcomes(page: Page, expected: dict[str, Any]) -> None:
    """The attribution panel: every outcome's tokens and share, its chart's first point, and
    the miss-ratio curves, as /v1/stats has them."""
    attribution, queried = expected["attribution"], expected["tokens_queried"]
    outcomes = {f"hit.{t}": n for t, n in attribution["hit"].items()}
    outcomes |= {f"lost.{r}": n for r, n in attribution["lost"].items()}
    assert sum(outcomes.values()) == queried  # every queried token is one outcome
    for key, n in outcomes.items():
        assert page.number(f"outcome.{key}") == n, key
        assert page.number(f"outcome_share.{key}") == pytest.approx(n / queried), key
        path = page.paths[("chart-outcomes", key)]
        assert float(path["data-first"]) == pytest.approx(n / queried), key
        assert path["data-points"] == "1"
    mrc = expected["mrc"]
    assert set(mrc["tiers"]) == {"l1", "l2"}
    for tier, curve in mrc["tiers"].items():
        path = page.paths[("chart-mrc", tier)]
        assert int(path["data-points"]) == len(mrc["multiples"])
        drawn = [float(v) for v in path["data-values"].split(",")]
        assert drawn == pytest.approx(curve["hit_rate"])
        for m, rate in zip(mrc["multiples"], curve["hit_rate"], strict=True):
            assert page.number(f"mrc.{tier}.{m:g}") == pytest.approx(rate)
    assert page.number("mrc.rate") == pytest.approx(mrc["sampling"]["rate"])


def test_dashboard_matches_stats(chromium: str, served: tuple, tmp_path: Path) -> None:
    url, _, expected = served
    # The workload must have exercised what the page shows.
    assert expected["hit_tokens"]["l1"] > 0 and expected["hit_tokens"]["l2"] > 0
    assert expected["evictions"] > 0 and expected["tokens_hit"] < expected["tokens_queried"]
    assert expected["moved_bytes"]["l1_to_l2"] > 0 and expected["moved_bytes"]["l2_to_l1"] > 0
    assert expected["host"] is not None
    lost = expected["attribution"]["lost"]
    assert lost["cold"] > 0 and lost["partial_page"] > 0  # losses for the panel to show
    page = Page(browse(chromium, f"{url}/dashboard", tmp_path))
    after = stats(url)
    assert store_part(after) == store_part(expected), "the store changed while the page polled"
    check_page(page, after)
    assert page.metrics["model"] == after["service"]["model"]
    assert page.number("endpoint./v1/insert") == PROMPTS
    assert page.number("endpoint./v1/stats") >= 2


def test_dashboard_screenshot(chromium: str, served: tuple, tmp_path: Path) -> None:
    url, _, _ = served
    shot = tmp_path / "dashboard.png"
    browse(chromium, f"{url}/dashboard", tmp_path, screenshot=shot)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 1500)
    # A blank or unstyled page compresses to a few KiB; charts, bars and tables do not.
    assert len(data) > 40_000, f"screenshot is only {len(data)} bytes"
    if dest := os.environ.get("TIERSTORE_DASHBOARD_PNG"):  # to look at it by hand
        shutil.copyfile(shot, dest)


@pytest.mark.parametrize("served", [TOKEN], indirect=True)
def test_dashboard_with_token(chromium: str, served: tuple, tmp_path: Path) -> None:
    url, token, _ = served
    status, _ = request(url, "/v1/stats")
    assert status == 401
    # A browser cannot add the header when it opens the page: /dashboard takes the token as
    # ?token= instead (and nothing without it); the page's own fetches send the header.
    assert request(url, "/dashboard")[0] == 401
    assert request(url, "/dashboard?token=wrong")[0] == 401
    status, html = request(url, f"/dashboard?token={token}")
    assert status == 200 and "data-metric" in html
    page = Page(browse(chromium, f"{url}/dashboard?token={token}", tmp_path))
    check_page(page, stats(url, token))
