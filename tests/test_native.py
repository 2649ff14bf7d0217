"""The optional compiled modules: which are built, and the switch to the pure-Python paths."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for pkg in ("tierstore", "gpu_arena") for p in (ROOT / pkg).glob("_c_*.c"))


def test_there_are_compiled_sources() -> None:
    assert SOURCES, "setup.py builds every <package>/_c_*.c; none found"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_each_source_is_built(source: Path) -> None:
    """A source that did not build leaves its pure path in use: a skip here, but a failure in CI
    (CI=true), where a silent fallback would leave the compiled path untested."""
    name = f"{source.parent.name}.{source.stem}"
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{name} did not build in CI: {exc}")
        pytest.skip(f"{name} not built here ({exc}); the pure-Python path is in use")


def test_pure_switch_turns_every_module_off() -> None:
    names = [f"{s.parent.name}.{s.stem}" for s in SOURCES]
    code = ("import sys; from tierstore import native; "
            "print(all(native.load(n) is None for n in sys.argv[1:]), native.active())")
    env = {**os.environ, "TIERSTORE_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code, *names], env=env, capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    assert out.startswith("True"), out
    assert all(f"'{n}': False" in out for n in names), out
