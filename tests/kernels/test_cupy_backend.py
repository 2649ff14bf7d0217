"""The CuPy glue against a fake ``cupy`` module: what it compiles, caches, launches and on which
stream. (The real thing runs in ``test_gpu.py`` on a GPU machine.)"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kernels import KernelArgumentError
from kernels._cuda import NVRTC_OPTIONS, CupyBackend, source


class FakeCupy:
    """Records RawModule builds, launches and the device/stream in force at each launch."""

    def __init__(self, *, broken: bool = False, pinned: bool = True,
                 external_stream: bool = False) -> None:
        self.builds: list[tuple[str, tuple[str, ...]]] = []
        self.launches: list[dict[str, Any]] = []
        self.current: dict[str, Any] = {"device": None, "stream": None}
        fake = self

        class RawModule:
            def __init__(self, *, code: str, options: tuple[str, ...]) -> None:
                fake.builds.append((code, options))

            def get_function(self, name: str) -> Any:
                if broken:
                    raise RuntimeError("nvrtc: error")

                def launch(grid: tuple, block: tuple, args: tuple) -> None:
                    fake.launches.append(dict(name=name, grid=grid, block=block, args=args,
                                              **fake.current))
                return launch

        @contextlib.contextmanager
        def device(index: int) -> Iterator[None]:
            fake.current["device"] = index
            yield
            fake.current["device"] = None

        class Stream:
            def __init__(self, ptr: int) -> None:
                self.ptr = ptr

            @classmethod
            def from_external(cls, obj: Any) -> Stream:
                return cls(obj.__cuda_stream__()[1])

            def __enter__(self) -> None:
                fake.current["stream"] = self.ptr

            def __exit__(self, *exc: object) -> None:
                fake.current["stream"] = None

        attrs = SimpleNamespace(type=1 if pinned else 0, devicePointer=0x7000 if pinned else 0)
        runtime = SimpleNamespace(memoryTypeHost=1, pointerGetAttributes=lambda ptr: attrs)
        self.RawModule = RawModule
        self.cuda = SimpleNamespace(Device=device, Stream=Stream, runtime=runtime)
        if external_stream:  # the long-standing wrapper: (pointer, device id)
            self.cuda.ExternalStream = lambda ptr, index: Stream(ptr)


class FakeTorchStream:
    cuda_stream = 0xABC

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.cuda_stream)


@pytest.mark.parametrize("external_stream", [True, False])
def test_compiles_each_module_once_per_device_and_launches_on_the_torch_stream(
    monkeypatch: pytest.MonkeyPatch, external_stream: bool,
) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: FakeTorchStream())
    fake = FakeCupy(external_stream=external_stream)
    backend = CupyBackend(fake)
    device = torch.device("cuda", 1)
    assert backend.ready("remap", ("remap_t64_i64_o64", "remap_t32_i32_o32"), device)
    backend.launch("remap", "remap_t64_i64_o64", device, (3, 1), 256, (1, 2**62, -5))
    backend.launch("remap", "remap_t32_i32_o32", device, (1, 1), 256, (7,))
    assert fake.builds == [(source("remap"), NVRTC_OPTIONS)]
    first = fake.launches[0]
    assert first["name"] == "remap_t64_i64_o64" and first["grid"] == (3, 1)
    assert first["block"] == (256,) and first["device"] == 1 and first["stream"] == 0xABC
    assert all(isinstance(a, np.int64) for a in first["args"])
    assert [int(a) for a in first["args"]] == [1, 2**62, -5]


def test_a_module_that_fails_to_compile_is_reported_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: FakeTorchStream())
    backend = CupyBackend(FakeCupy(broken=True))
    device = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="kernels._cuda"):
        assert not backend.ready("strided_copy", ("strided_copy",), device)
        assert not backend.ready("strided_copy", ("strided_copy",), device)
    assert len([r for r in caplog.records if "failed to load" in r.message]) == 1


def test_a_stream_that_cannot_be_wrapped_disables_the_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No launch would work, so the callers fall back to the torch reference."""
    class Opaque:  # neither a pointer CuPy can take nor the __cuda_stream__ protocol
        cuda_stream = 0xABC

    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: Opaque())
    assert not CupyBackend(FakeCupy()).ready("remap", ("remap_t64_i64_o64",),
                                             torch.device("cuda", 0))


def test_host_pointers_must_be_pinned() -> None:
    host = torch.zeros(8, dtype=torch.uint8)
    assert CupyBackend(FakeCupy()).pointer(host) == 0x7000
    with pytest.raises(KernelArgumentError, match="is not pinned"):
        CupyBackend(FakeCupy(pinned=False)).pointer(host)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_no_cuda_means_no_kernels() -> None:
    import kernels

    assert not kernels.cuda_kernels_ready()
