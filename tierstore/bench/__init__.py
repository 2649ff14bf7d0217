"""Benchmarks behind ``tierstore bench NAME``.

Each benchmark is a module in this package exposing::

    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> dict   # the figures, JSON-serialisable
    def render(result: dict) -> str              # a human-readable table of the same figures

``tierstore bench NAME`` prints ``render(result)``; with ``--json`` it prints the JSON object as
its last line as well. Speed-ups are always ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def names() -> list[str]:
    """Every benchmark's name, without importing any (some pull in heavy optional packages)."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__)
                  if not info.name.startswith("_"))


def load(name: str) -> ModuleType:
    """The benchmark module ``name``."""
    module = importlib.import_module(f"{__name__}.{name}")
    if not (hasattr(module, "run") and hasattr(module, "add_arguments")):
        raise LookupError(f"{name} is not a benchmark module")
    return module


def available() -> dict[str, ModuleType]:
    """Every benchmark module in this package, keyed by its name (imports them all)."""
    return {name: load(name) for name in names()}
