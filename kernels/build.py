"""Compile every ``kernels/*.cu`` with nvcc, so that CI without a GPU still rejects broken kernels.

``python -m kernels.build --check`` builds each source to a cubin (nvcc front end and ptxas)
in a temporary directory and exits 1 with the compiler output on any error or warning; it exits
0 with a message when nvcc is not installed. At run time the same sources are compiled by
NVRTC through CuPy, which is why they include no headers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

SOURCE_DIR = Path(__file__).resolve().parent
DEFAULT_ARCH = "sm_90"
TIMEOUT_S = 300


class BuildResult(NamedTuple):
    """How compiling one source went."""

    source: Path
    ok: bool
    output: str


def find_nvcc() -> str | None:
    """nvcc on PATH, else under ``$CUDA_HOME`` or ``/usr/local/cuda``; None when absent."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def sources() -> list[Path]:
    """Every CUDA source of the package, sorted."""
    return sorted(SOURCE_DIR.glob("*.cu"))


def compile_source(nvcc: str, source: Path, arch: str, out_dir: Path) -> BuildResult:
    """Compile ``source`` to ``out_dir/<stem>.cubin``; warnings count as errors."""
    cmd = [nvcc, f"-arch={arch}", "--cubin", "-std=c++17", "-Werror", "all-warnings",
           "-o", str(out_dir / f"{source.stem}.cubin"), str(source)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return BuildResult(source, False, f"nvcc timed out after {TIMEOUT_S} s")
    return BuildResult(source, proc.returncode == 0, (proc.stdout + proc.stderr).strip())


def check(arch: str = DEFAULT_ARCH, paths: list[Path] | None = None) -> int:
    """Compile ``paths`` (default: every source) and print one line each; return the exit code."""
    nvcc = find_nvcc()
    if nvcc is None:
        print("kernels.build: nvcc not found; skipping the CUDA compile check")
        return 0
    failed = 0
    with tempfile.TemporaryDirectory(prefix="tierstore-cu-") as tmp:
        for source in paths if paths is not None else sources():
            result = compile_source(nvcc, source, arch, Path(tmp))
            print(f"kernels.build: {source.name} [{arch}] {'ok' if result.ok else 'FAILED'}")
            if not result.ok:
                failed += 1
                print(result.output, file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.build", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compile every .cu and report")
    parser.add_argument("--arch", default=DEFAULT_ARCH, help="nvcc -arch (default %(default)s)")
    parser.add_argument("files", nargs="*", type=Path, help="sources (default: kernels/*.cu)")
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 2
    return check(args.arch, args.files or None)


if __name__ == "__main__":
    sys.exit(main())
