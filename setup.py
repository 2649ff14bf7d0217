"""Optional compiled hot paths (metadata lives in pyproject.toml).

Every ``<package>/_c_<name>.c`` builds as the extension ``<package>._c_<name>``. A line
``// link: crypto m`` in the source names the libraries it links, a line ``// sources: a.c b.c``
more files of the same package compiled into it (named without the ``_c_`` prefix, so they are
not extensions of their own); headers beside them (``<package>/*.h``) are their dependencies,
rebuilt against. Each extension is optional:
where it does not build (no compiler, no headers) the install still succeeds and the package
uses its pure-Python path, which CI tests as well (``TIERSTORE_PURE_PYTHON=1``).
"""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import Extension, setup

PACKAGES = ("tierstore", "gpu_arena")
_LINK = re.compile(r"^//\s*link:\s*(.+)$", re.MULTILINE)
_SOURCES = re.compile(r"^//\s*sources:\s*(.+)$", re.MULTILINE)


def _extensions() -> list[Extension]:
    found = []
    for package in PACKAGES:
        for source in sorted(Path(package).glob("_c_*.c")):
            text = source.read_text()
            link, more = _LINK.search(text), _SOURCES.search(text)
            extra = [str(Path(package) / name) for name in more.group(1).split()] if more else []
            found.append(Extension(
                f"{package}.{source.stem}", [str(source), *extra],
                depends=[str(h) for h in sorted(Path(package).glob("*.h"))],
                libraries=link.group(1).split() if link else [],
                extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
                optional=True,
            ))
    return found


setup(ext_modules=_extensions())
