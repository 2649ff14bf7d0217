"""Adapters that plug tierstore into inference engines (each imports its engine lazily).

- :mod:`tierstore.integrations.sglang`: SGLang HiCache L3 storage backend (``dynamic``).
"""
