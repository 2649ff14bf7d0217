"""One exception root: every public error of the packages derives from TierStoreError, through
one family, and keeps the builtin base its callers catch."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

from tierstore.errors import InternalError, TierStoreError, UnavailableError, UsageError

# The packages the wheel ships, as pyproject.toml lists them (tests/test_imports.py reads the
# same line; test modules cannot import each other under --import-mode=importlib).
PACKAGES = tuple(re.findall(r'"(\w+)\*"', re.search(
    r"\[tool\.setuptools\.packages\.find\]\s*include = \[(.*?)\]",
    (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(),
    re.S).group(1)))  # type: ignore[union-attr]


def _defines_public_subclasses(module_name: str) -> bool:
    """Whether the module's source defines a public class with a base (read, not imported:
    importing every module would load SGLang for the benches)."""
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin is not None
    if not spec.origin.endswith(".py"):
        return False  # a compiled _c_* extension: no source to read, no exception classes
    tree = ast.parse(Path(spec.origin).read_text())
    return any(isinstance(n, ast.ClassDef) and n.bases and not n.name.startswith("_")
               for n in ast.walk(tree))


def _public_errors() -> dict[str, type[BaseException]]:
    """Every public exception class defined in a module of the packages (tierstore.testing
    aside), by dotted name. Modules whose optional dependencies are absent are skipped."""
    out: dict[str, type[BaseException]] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        names = [name, *(m.name for m in pkgutil.walk_packages(package.__path__, name + "."))]
        for module_name in names:
            if module_name.startswith("tierstore.testing") or module_name.endswith("__main__"):
                continue  # test helpers; `python -m` entry points run when imported
            if not _defines_public_subclasses(module_name):
                continue
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                if (exc.name or "").split(".")[0] in PACKAGES:
                    raise  # our own module failing to import is a bug, not an absent extra
                continue
            for cls_name, cls in inspect.getmembers(module, inspect.isclass):
                if (issubclass(cls, BaseException) and cls.__module__ == module_name
                        and not cls_name.startswith("_")):
                    out[f"{module_name}.{cls_name}"] = cls
    return out


ERRORS = _public_errors()


def test_every_public_error_has_the_root() -> None:
    assert len(ERRORS) >= 30, sorted(ERRORS)  # the walk found the packages' errors
    rootless = sorted(n for n, cls in ERRORS.items() if not issubclass(cls, TierStoreError))
    assert not rootless, f"errors outside the TierStoreError tree: {rootless}"


@pytest.mark.parametrize(("name", "family", "builtin"), [
    ("tierstore.errors.TokenError", UsageError, ValueError),
    ("tierstore.errors.ShapeError", UsageError, ValueError),
    ("tierstore.architectures.LayoutError", UsageError, ValueError),
    ("tierstore.replay.trace.TraceError", UsageError, ValueError),
    ("tierstore.service.kv.BadKeyError", UsageError, ValueError),
    ("gpu_arena.spec.ArenaError", UsageError, ValueError),
    ("gpu_arena.spec.IntegrityError", InternalError, AssertionError),
    ("host_tier.slots.SlotError", UsageError, ValueError),
    ("host_tier.shm.ShmError", UnavailableError, OSError),
    ("kernels.errors.KernelArgumentError", UsageError, ValueError),
    ("remote_tier.errors.RemoteUnavailable", UnavailableError, Exception),
    ("remote_tier.errors.BadKey", UsageError.__mro__[1], ValueError),
    ("tierstore.shm_client.ShmUnavailable", UnavailableError, RuntimeError),
    ("tierstore.shm_client.ServiceUnreachable", UnavailableError, RuntimeError),
    ("tierstore.shm_client.LeaseExpired", TierStoreError, RuntimeError),
    ("tierstore.client.ServiceError", TierStoreError, Exception),
    ("tierstore.service.body.HTTPError", TierStoreError, Exception),
])
def test_families_and_builtin_bases_are_kept(name: str, family: type, builtin: type) -> None:
    # Callers catch the builtin bases (except ValueError / OSError / RuntimeError), so each
    # error keeps the one it had besides joining its family.
    cls = ERRORS[name]
    assert issubclass(cls, family) and issubclass(cls, builtin), cls.__mro__


def test_a_usage_error_is_not_an_outage() -> None:
    # The families do not overlap: a handler for one never swallows another.
    for a, b in [(UsageError, UnavailableError), (UsageError, InternalError),
                 (UnavailableError, InternalError)]:
        assert not issubclass(a, b) and not issubclass(b, a)
    with pytest.raises(UsageError):
        raise ERRORS["gpu_arena.spec.ArenaError"]("unknown pool 'x'")
    with pytest.raises(TierStoreError):
        raise ERRORS["remote_tier.errors.RemoteUnavailable"]("redis down")
