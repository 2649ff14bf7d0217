"""Every ``kernels/*.cu`` compiles with nvcc (CI has nvcc but no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import build

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")


def test_every_cuda_source_compiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert build.sources(), "no .cu files found next to kernels/build.py"
    code = build.check()
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.count(" ok") == len(build.sources())


def test_a_broken_source_fails_the_check(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(int* p) { p[0] = ; }\n')
    assert build.check(paths=[bad]) == 1
    warns = tmp_path / "warns.cu"
    warns.write_text('extern "C" __global__ void k(int* p) { int unused; p[0] = 1; }\n')
    assert build.check(paths=[warns]) == 1
