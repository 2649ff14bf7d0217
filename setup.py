"""Optional compiled hot paths (metadata lives in pyproject.toml).

Every ``<package>/_c_<name>.c`` builds as the extension ``<package>._c_<name>``. A line
``// link: crypto m`` in the source names the libraries it links. Each extension is optional:
where it does not build (no compiler, no headers) the install still succeeds and the package
uses its pure-Python path, which CI tests as well (``TIERSTORE_PURE_PYTHON=1``).
"""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import Extension, setup

PACKAGES = ("tierstore", "gpu_arena")
_LINK = re.compile(r"^//\s*link:\s*(.+)$", re.MULTILINE)


def _extensions() -> list[Extension]:
    found = []
    for package in PACKAGES:
        for source in sorted(Path(package).glob("_c_*.c")):
            link = _LINK.search(source.read_text())
            found.append(Extension(
                f"{package}.{source.stem}", [str(source)],
                libraries=link.group(1).split() if link else [],
                extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
                optional=True,
            ))
    return found


setup(ext_modules=_extensions())
