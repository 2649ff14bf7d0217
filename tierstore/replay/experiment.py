"""One replay experiment: trace + model + capacities -> every configuration's figures.

Sizes are real bytes (``40GiB``, ``512MiB``, ``1.5TB``, a plain integer) or fractions of the
trace's working set (``5%``) — what an infinite cache holds after the trace at the model's real
envelope sizes (:func:`~tierstore.replay.trace.working_set`). An L3 of 100% or more is
unbounded. Everything runs at scale (:mod:`~tierstore.scaling`): capacities are
multiplied by the scale factor, figures divided by it.

The fixed split (configuration b) gives each kind a fixed share of the GPU bytes. ``auto``
takes the kinds' shares of the working set of the first ``split_warmup`` of the requests (an
operator sizing pools on early traffic); the whole trace's shares are reported beside it.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierstore.layout import load_preset
from tierstore.mrc import shadow_for
from tierstore.replay.driver import Replay
from tierstore.replay.plot import write_html
from tierstore.replay.report import (
    CostModel,
    cumulative,
    outcome_shares,
    summarize,
    windowed,
)
from tierstore.replay.service import ServiceTarget
from tierstore.replay.targets import (
    BASELINES,
    Capacities,
    LibraryTarget,
    ReplayTarget,
    open_target,
)
from tierstore.replay.trace import (
    TraceRequest,
    WorkingSet,
    load_trace,
    page_identities,
    working_set,
)
from tierstore.scaling import auto_factor, scale_layout

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class Size:
    """A capacity: ``fraction`` of the working set, or ``nbytes`` real bytes."""

    fraction: float | None = None
    nbytes: int | None = None

    @classmethod
    def parse(cls, text: str) -> Size:
        """``5%`` is a fraction of the working set; anything else is bytes with an optional
        unit (K, M, G, T decimal; KiB, MiB, GiB, TiB binary). A bare ``0.05`` is 0 bytes:
        fractions always take ``%``."""
        text = str(text).strip()
        if text.endswith("%"):
            value = float(text[:-1])
            if not value > 0:
                raise ValueError(f"size {text!r}: a fraction must be > 0%")
            return cls(fraction=value / 100)
        m = _SIZE.fullmatch(text)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"size {text!r}: expected e.g. 5%, 40GiB, 512MB or a byte count")
        nbytes = int(float(m.group(1)) * _UNITS[unit])
        if nbytes <= 0:
            raise ValueError(f"size {text!r} must be positive")
        return cls(nbytes=nbytes)

    def real_bytes(self, ws: WorkingSet) -> int:
        if self.fraction is not None:
            return int(self.fraction * ws.total_bytes)
        assert self.nbytes is not None
        return self.nbytes

    def unbounded(self, ws: WorkingSet) -> bool:
        return self.real_bytes(ws) >= ws.total_bytes

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        assert self.nbytes is not None
        return f"{self.nbytes / 2**30:,.4g} GiB"


@dataclass(frozen=True)
class Setup:
    """Everything one experiment needs (the bench maps its flags onto this)."""

    trace: Path
    limit: int | None = None
    model: str = "qwen3-next-80b-a3b"
    page_size: int = 512
    l1: Size = field(default_factory=lambda: Size(fraction=0.05))
    l2: Size = field(default_factory=lambda: Size(fraction=0.20))
    l3: Size = field(default_factory=lambda: Size(fraction=1.0))
    configs: str = "abcdef"
    scale: float | None = None  # None: auto
    scaled_target_bytes: int = 512 << 20
    split: Mapping[str, float] | None = None  # None: auto
    split_warmup: float = 0.1
    decode_s_per_token: float = 0.02
    seed: int = 0
    verify: bool = True
    progress: bool = True
    cost: CostModel = field(default_factory=CostModel)
    plot: Path | None = None
    window_s: float = 60.0
    url: str | None = None  # service mode: a running `tierstore serve --scale N`
    auth_token: str | None = None
    speed: float | None = None  # service mode: trace time / wall time (None: as fast as it can)

    def __post_init__(self) -> None:
        unknown = set(self.configs) - set(BASELINES)
        if not self.configs or unknown:
            raise ValueError(f"configs must be letters of {''.join(BASELINES)}, got "
                             f"{self.configs!r}")
        if not 0 < self.split_warmup <= 1:
            raise ValueError(f"split_warmup must be in (0, 1], got {self.split_warmup}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"limit must be positive, got {self.limit}")


def _shares(ws: WorkingSet) -> dict[str, float]:
    total = ws.total_bytes
    return {k: (v / total if total else 1 / len(ws.nbytes)) for k, v in ws.nbytes.items()}


def resolve_split(given: Mapping[str, float] | None, kinds: Sequence[str],
                  warmup: WorkingSet) -> dict[str, float]:
    """Shares of the GPU bytes per kind: ``given`` (kinds it omits share the rest evenly) or
    the warm-up working set's byte shares."""
    if given is None:
        return _shares(warmup)
    bad = set(given) - set(kinds)
    if bad:
        raise ValueError(f"split names kinds {sorted(bad)} the layout lacks; kinds: {kinds}")
    if any(not 0 < v < 1 for v in given.values()) or sum(given.values()) > 1:
        raise ValueError(f"split shares must be in (0, 1) and sum to at most 1, got {given}")
    rest = [k for k in kinds if k not in given]
    left = 1 - sum(given.values())
    if not rest and not math.isclose(left, 0, abs_tol=1e-9):
        raise ValueError(f"split shares of every kind must sum to 1, got {given}")
    return {k: given[k] if k in given else left / len(rest) for k in kinds}


def prefix_ideal(requests: Sequence[TraceRequest], page_size: int) -> float:
    """Prompt-token hit rate if every earlier request's full pages were cached at arrival,
    with no hybrid rule (KV pages alone make a match) and no completion delay: the trace's
    upper bound (the trace README's 64.0% counts blocks, this counts tokens)."""
    seen: set[tuple[int, int]] = set()
    hit = total = 0
    for r in requests:
        n = (r.input_length - 1) // page_size  # what a lookup of prompt[:-1] can match
        pages = page_identities(r, page_size)
        k = 0
        while k < n and pages[k] in seen:
            k += 1
        hit += k * page_size
        total += r.input_length
        seen.update(pages)
    return hit / total if total else 0.0


def _explained(target: ReplayTarget) -> dict[str, Any]:
    """A library target's attribution totals and miss-ratio curves (a service's are at its
    own /v1/stats)."""
    if not isinstance(target, LibraryTarget):
        return {}
    store = target.store
    return {"attribution": store.attribution.snapshot(), "mrc": store.mrc.curves()}


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """Torch intra-op threads slow the replay's small copies ~100x on a busy 2-core machine
    (thread hand-off per op); one thread for the duration."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(setup: Setup) -> dict[str, Any]:
    """Replay the trace against every configuration in ``setup.configs``; the figures."""
    started = time.perf_counter()
    requests = load_trace(setup.trace, setup.limit)
    if not requests:
        raise ValueError(f"{setup.trace}: no requests")
    real = load_preset(setup.model, page_size=setup.page_size)
    ws = working_set(requests, real)
    warm = working_set(requests[: max(1, round(len(requests) * setup.split_warmup))], real)
    factor = setup.scale or auto_factor(ws.total_bytes, setup.scaled_target_bytes)
    scaled = scale_layout(real, factor)
    kinds = list(real.envelopes())
    split = resolve_split(setup.split, kinds, warm)
    l3_unbounded = setup.l3.unbounded(ws)
    units = [e.nbytes for e in scaled.layout.envelopes().values()]
    slack = max(units) * 64 + scaled.scaled_bytes(ws.total_bytes) // 100
    caps = Capacities(
        l1=scaled.scaled_bytes(setup.l1.real_bytes(ws)),
        l2=scaled.scaled_bytes(setup.l2.real_bytes(ws)),
        l3=None if l3_unbounded else scaled.scaled_bytes(setup.l3.real_bytes(ws)),
        infinite=scaled.scaled_bytes(ws.total_bytes) + slack // 16 * 16,
        split=split, mix=_shares(ws))
    targets: list[ReplayTarget] = []
    with _single_thread():
        try:
            if setup.url:
                hint = (f"Start it with: tierstore serve --model {setup.model} --page-size "
                        f"{setup.page_size} --scale 1/{1 / factor:g}, and pass --scale "
                        f"1/{1 / factor:g} here.")
                targets.append(ServiceTarget(setup.url, scaled.layout, token=setup.auth_token,
                                             verify=setup.verify, serve_hint=hint))
            for key in setup.configs if not setup.url else "":
                target = open_target(BASELINES[key], scaled.layout, caps, verify=setup.verify)
                # Offline, the shadow samples pages at 1 until 16,384 are tracked (the serving
                # default starts at 1/16 to stay cheap per request).
                store = target.store
                store.mrc = shadow_for(store.config, store.layout,
                                       swa_window_only=store._swa_window_only,
                                       l3_bytes=caps.l3, rate=1.0)
                targets.append(target)
            replay = Replay(targets, scaled.layout, decode_s_per_token=setup.decode_s_per_token,
                            seed=setup.seed)
            series = replay.run(requests, progress=setup.progress, speed=setup.speed)
            for t in targets:
                t.check()
            figures = {t.name: {**t.figures(), **_explained(t)} for t in targets}
        finally:
            for t in targets:
                t.close()
    rows = [summarize(t.name, figures[t.name], series, scaled, setup.cost) for t in targets]
    result: dict[str, Any] = {
        "trace": str(setup.trace), "requests": len(requests),
        "trace_seconds": requests[-1].arrival_s, "model": setup.model,
        "page_size": setup.page_size,
        "prompt_tokens": int(sum(series.prompt_tokens)),
        "working_set": {"entries": ws.entries, "real_bytes": ws.nbytes,
                        "total_real_bytes": ws.total_bytes},
        "prefix_ideal_kv_only": prefix_ideal(requests, setup.page_size),
        "scale": scaled.describe(),
        "capacities_real_bytes": {
            "l1": setup.l1.real_bytes(ws), "l2": setup.l2.real_bytes(ws),
            "l3": None if l3_unbounded else setup.l3.real_bytes(ws),
            "infinite": scaled.real_bytes(caps.infinite)},
        "capacities_scaled_bytes": {"l1": caps.l1, "l2": caps.l2, "l3": caps.l3,
                                    "infinite": caps.infinite},
        "sizes": {"l1": str(setup.l1), "l2": str(setup.l2), "l3": str(setup.l3)},
        "fixed_split": {"shares": split, "source": "given" if setup.split else
                        f"working set of the first {setup.split_warmup:.0%} of requests",
                        "whole_trace_shares": _shares(ws)},
        "time_model": {"decode_s_per_token": setup.decode_s_per_token},
        "cost_model": asdict(setup.cost),
        "configs": {"service": f"a running service at {setup.url}"} if setup.url else
                   {BASELINES[k].name: f"({k}) {BASELINES[k].description}"
                    for k in setup.configs},
        "rows": rows,
        "windowed": {"window_s": setup.window_s,
                     "series": {t.name: [[round(a, 1), round(b, 4)] for a, b in
                                         windowed(series, t.name, setup.window_s)]
                                for t in targets}},
        "runtime_s": time.perf_counter() - started,
    }
    if setup.plot is not None:
        title = (f"tierstore replay: {setup.model}, {len(requests)} requests, "
                 f"L1 {setup.l1}, L2 {setup.l2}, L3 {setup.l3}")
        subtitle = (f"{setup.trace.name}; working set {ws.total_bytes / 2**30:,.0f} GiB at "
                    f"real sizes, run at scale 1/{1 / factor:g}; hybrid match rule, one state "
                    f"checkpoint at each prompt's last full page; a request inserts its prompt "
                    f"output_length x {setup.decode_s_per_token * 1000:g} ms after arrival")
        path = write_html(setup.plot, title, subtitle, setup.window_s,
                          {t.name: windowed(series, t.name, setup.window_s) for t in targets},
                          {t.name: cumulative(series, t.name) for t in targets},
                          {str(r["config"]): outcome_shares(r["tokens"])  # type: ignore[arg-type]
                           for r in rows if "tokens" in r})
        result["plot"] = str(path)
    return result
