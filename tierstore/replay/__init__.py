"""Trace replay: Mooncake-style request traces against tierstore and its baselines.

One file per concept: ``trace`` (loading, working set), ``blocks`` (deterministic token
blocks), ``scaled`` (scale mode: real-size accounting, small verified payloads), ``targets``
(what a replay drives: the library target, the configurations compared; service mode goes
here), ``l3`` (a private Redis bounded to the scaled L3 size), ``driver`` (the replay loop and
its time model), ``report`` (figures and the cost model), ``plot`` (HTML/SVG), ``experiment``
(one whole run). ``tierstore bench replay`` is the command line.
"""

from tierstore.replay.driver import Replay, Series
from tierstore.replay.experiment import Setup, Size, run
from tierstore.replay.report import CostModel
from tierstore.replay.targets import BASELINES, LibraryTarget, ReplayIntegrityError, ReplayTarget
from tierstore.replay.trace import TraceRequest, load_trace, working_set

__all__ = [
    "BASELINES", "CostModel", "LibraryTarget", "Replay", "ReplayIntegrityError",
    "ReplayTarget", "Series", "Setup", "Size", "TraceRequest", "load_trace", "run",
    "working_set",
]
