"""Request traces in the Mooncake format, and the working set they imply for a layout.

One request per line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}``. Each hash id stands for one 512-token block of the prompt; ids are
position-remapped block hashes, so an id fixes every block before it too (a shared id means a
shared prefix up to it). The last block may be partial: ``input_length`` is exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierstore.errors import UsageError
from tierstore.layout import ModelLayout

BLOCK_TOKENS = 512  # tokens per trace block (Mooncake's hash block size)
TRACE_NAME = "synthetic_trace.jsonl"


class TraceError(UsageError):
    """A trace the replay cannot use (a line of one, a generated one's parameters, a
    ``--trace`` argument); the message names the line and the field, or the argument."""


@dataclass(frozen=True, eq=False)
class TraceRequest:
    """One request: arrival time (seconds from the trace start), prompt and output lengths in
    tokens, and the hash id of each 512-token prompt block."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: np.ndarray  # int64, one per block (the last may be partial)


def default_trace() -> Path | None:
    """Mooncake's synthetic trace beside a checkout, ``../shared/traces/synthetic_trace.jsonl``
    seen from the working directory or the repository root (tests replay it when it is
    there); None when neither exists. ``bench replay`` defaults to a generated trace."""
    repo = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), repo):
        path = base.parent / "shared" / "traces" / TRACE_NAME
        if path.is_file():
            return path
    return None


def _field(record: dict, key: str, line: int) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"line {line}: {key!r} = {value!r} must be a non-negative integer")
    return value


def parse_trace(lines: Iterable[str], limit: int | None = None) -> list[TraceRequest]:
    """Requests from trace lines, in arrival order (a stable sort by timestamp); at most
    ``limit`` (the first ``limit`` lines with a request). Blank lines are skipped."""
    raw: list[tuple[int, int, int, list[int]]] = []
    for line_no, line in enumerate(lines, 1):
        if limit is not None and len(raw) >= limit:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"line {line_no}: not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise TraceError(f"line {line_no}: expected an object, got {type(record).__name__}")
        ts = _field(record, "timestamp", line_no)
        n_in = _field(record, "input_length", line_no)
        n_out = _field(record, "output_length", line_no)
        ids = record.get("hash_ids")
        if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise TraceError(f"line {line_no}: 'hash_ids' must be a list of non-negative ints")
        if n_in > len(ids) * BLOCK_TOKENS or n_in <= (len(ids) - 1) * BLOCK_TOKENS:
            raise TraceError(f"line {line_no}: input_length {n_in} does not fit {len(ids)} "
                             f"blocks of {BLOCK_TOKENS} tokens")
        raw.append((ts, n_in, n_out, ids))
    order = sorted(range(len(raw)), key=lambda i: raw[i][0])
    return [TraceRequest(k, raw[i][0] / 1000.0, raw[i][1], raw[i][2],
                         np.asarray(raw[i][3], dtype=np.int64)) for k, i in enumerate(order)]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace file (see :func:`parse_trace`)."""
    with open(path, encoding="utf-8") as fh:
        return parse_trace(fh, limit)


@dataclass(frozen=True)
class WorkingSet:
    """What an infinite cache ends up holding after the trace, at a layout's real sizes:
    distinct full pages (``kv``), SWA pages kept (``swa``) and state checkpoints (``state``),
    as entry counts and bytes per kind."""

    entries: dict[str, int]
    nbytes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    @property
    def total_entries(self) -> int:
        return sum(self.entries.values())


def page_identities(request: TraceRequest, page_size: int) -> list[tuple[int, int]]:
    """An identity per full page of the prompt: (hash id of the block holding the page's last
    token, page index). The id fixes every token before it, so equal identities are equal
    page keys."""
    n_pages = request.input_length // page_size
    ids = request.hash_ids
    return [(int(ids[((p + 1) * page_size - 1) // BLOCK_TOKENS]), p) for p in range(n_pages)]


def working_set(requests: Sequence[TraceRequest], layout: ModelLayout) -> WorkingSet:
    """The working set of ``requests`` when every prompt's full pages are cached with a state
    checkpoint at the last full page (layouts with recurrent state). SWA pages follow the
    store's ``auto`` retention: all pages without recurrent state, else only the window
    before each checkpoint."""
    pages: set[tuple[int, int]] = set()
    checkpoints: set[tuple[int, int]] = set()
    swa: set[tuple[int, int]] = set()
    window = layout.swa_window_pages()
    for request in requests:
        ids = page_identities(request, layout.page_size)
        pages.update(ids)
        if ids and layout.state is not None:
            checkpoints.add(ids[-1])
            if layout.swa is not None:
                swa.update(ids[-window:])
    if layout.swa is not None and layout.state is None:
        swa = pages
    counts = {"kv": len(pages), "swa": len(swa), "state": len(checkpoints)}
    envelopes = layout.envelopes()
    entries = {k: counts[k] for k in envelopes}
    return WorkingSet(entries, {k: n * envelopes[k].nbytes for k, n in entries.items()})
