"""The optional compiled hot paths (``setup.py`` builds every ``<package>/_c_*.c``).

Each user of a compiled module keeps a pure-Python path with the same results; :func:`load`
returns the module, or None where it was not built or ``TIERSTORE_PURE_PYTHON=1`` asks for the
pure paths (CI runs the tests both ways). :func:`active` says which are in use.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)

PURE = os.environ.get("TIERSTORE_PURE_PYTHON", "") not in ("", "0")
_loaded: dict[str, bool] = {}


def load(name: str) -> ModuleType | None:
    """The compiled module ``name`` (e.g. ``"tierstore._c_chain"``), or None for the
    pure-Python path."""
    if PURE:
        _loaded[name] = False
        return None
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        log.debug("%s not built (%s): using the pure-Python path", name, exc)
        _loaded[name] = False
        return None
    _loaded[name] = True
    return module


def active() -> dict[str, bool]:
    """Each compiled module asked for so far, and whether it is in use."""
    return dict(_loaded)
