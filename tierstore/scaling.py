"""Scale mode: real-size accounting with small stored envelopes.

The arena's, host tier's and eviction's decisions depend only on byte *ratios* (envelope sizes
against each other and against capacities). A scaled layout multiplies every envelope's size by
one factor ``f`` and rounds it to the arena's 16-byte alignment; every capacity is multiplied by
the same ``f``. Byte figures are reported divided by ``f`` (real bytes). With ``f = 2**-k`` the
presets' 256-byte-aligned envelopes usually scale exactly (Qwen3-Next at ``f = 1/2048``: KV page
6,144 B, state 37,728 B, ratio error 0).

``tierstore serve --scale`` and the replay (``tierstore.replay``) both use it; each scaled
envelope is one ``uint8`` field spanning it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from gpu_arena.spec import ALIGN
from tierstore.layout import Envelope, Field, ModelLayout


def _round_align(value: float) -> int:
    """``value`` rounded to the nearest multiple of the arena's alignment (at least one)."""
    return max(ALIGN, round(value / ALIGN) * ALIGN)


@dataclass(frozen=True)
class ScaledLayout:
    """A real layout, its scaled twin and the factor between them."""

    real: ModelLayout
    layout: ModelLayout
    factor: float

    def scaled_bytes(self, real_bytes: float) -> int:
        """A real capacity in scaled bytes (rounded to the arena's alignment)."""
        return _round_align(real_bytes * self.factor)

    def real_bytes(self, scaled_bytes: float) -> float:
        """Scaled bytes (a measured figure) in real bytes."""
        return scaled_bytes / self.factor

    def ratio_errors(self) -> dict[str, float]:
        """Per kind, ``scaled / (real * f) - 1``: how far rounding moved each envelope."""
        real = self.real.envelopes()
        return {k: e.nbytes / (real[k].nbytes * self.factor) - 1
                for k, e in self.layout.envelopes().items()}

    def describe(self) -> dict[str, object]:
        """Factor, envelope sizes (real and scaled) and rounding errors, for reports."""
        real = self.real.envelopes()
        return {"factor": self.factor, "inverse": 1 / self.factor,
                "envelopes": {k: {"real_bytes": real[k].nbytes, "scaled_bytes": e.nbytes}
                              for k, e in self.layout.envelopes().items()},
                "ratio_error": self.ratio_errors()}


def parse_scale(text: str) -> float | None:
    """A scale factor from ``"auto"`` (None), ``"1/2048"`` or ``"0.00048828125"``."""
    if text == "auto":
        return None
    num, _, den = text.partition("/")
    try:
        factor = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"scale must be 'auto', a fraction like 1/2048 or a float, got "
                         f"{text!r}") from None
    if not 0 < factor <= 1:
        raise ValueError(f"scale must be in (0, 1], got {text!r}")
    return factor


def auto_factor(real_bytes: int, target_bytes: int) -> float:
    """The largest ``2**-k`` (k >= 0) that scales ``real_bytes`` to at most ``target_bytes``."""
    if real_bytes <= 0 or target_bytes <= 0:
        raise ValueError(f"need positive sizes, got {real_bytes} and {target_bytes}")
    k = max(0, math.ceil(math.log2(real_bytes / target_bytes)))
    return 2.0 ** -k


def scale_layout(real: ModelLayout, factor: float) -> ScaledLayout:
    """The layout of ``real`` with every envelope ``factor`` times its size (16-byte aligned,
    one ``uint8`` field) and its own fingerprint (so scaled pages never meet real ones)."""
    if not 0 < factor <= 1:
        raise ValueError(f"scale factor must be in (0, 1], got {factor}")
    envelopes: dict[str, Envelope | None] = {"kv": None, "swa": None, "state": None}
    for kind, env in real.envelopes().items():
        n = _round_align(env.nbytes * factor)
        field = Field("payload", torch.uint8, (n,), (1,), 0)
        envelopes[kind] = Envelope(env.kind, n, n, (field,))
    text = f"{real.fingerprint}|scaled|{factor!r}|" + ",".join(
        f"{k}={e.nbytes}" for k, e in envelopes.items() if e is not None)
    layout = ModelLayout(
        name=f"{real.name}@scaled", page_size=real.page_size, kv=envelopes["kv"],
        swa=envelopes["swa"], state=envelopes["state"], sliding_window=real.sliding_window,
        full_layers=real.full_layers, swa_layers=real.swa_layers,
        recurrent_layers=real.recurrent_layers, tp_rank=real.tp_rank, tp_size=real.tp_size,
        fingerprint=hashlib.sha256(text.encode()).hexdigest())
    return ScaledLayout(real, layout, factor)
