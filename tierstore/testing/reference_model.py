"""The tiny reference model for tests (it lives in ``tierstore.reference_model``: the demo
and benchmarks use it too)."""

from tierstore.reference_model import CONFIG, ReferenceModel, Served, tiny_layout

__all__ = ["CONFIG", "ReferenceModel", "Served", "tiny_layout"]
