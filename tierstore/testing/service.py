"""The in-process service runner for tests (it lives in ``tierstore.service.running``: the
demo and benchmarks use it too)."""

from tierstore.service.running import RunningService, free_port

__all__ = ["RunningService", "free_port"]
