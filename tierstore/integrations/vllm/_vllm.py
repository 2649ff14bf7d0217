"""vLLM's tiering types, imported once; ``AVAILABLE`` is False (and ``IMPORT_ERROR`` says why)
when vLLM 0.33 is not installed, so that importing the tier never needs it."""

from __future__ import annotations

from typing import Any

AVAILABLE = False
IMPORT_ERROR: ImportError | None = None
SecondaryTierManager: Any = None
JobResult: Any = None
LookupResult: Any = None
Locality: Any = None
RequestOffloadingContext: Any = None
CacheHitSource: Any = None
OffloadingConnectorStats: Any = None
OffloadingCounterMetadata: Any = None
OffloadingGaugeMetadata: Any = None

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics as _stats
    from vllm.v1.kv_offload import base as _base
    from vllm.v1.kv_offload.tiering import base as _tiering
    from vllm.v1.metrics import cache_hit_source as _hits
except ImportError as exc:  # the optional extra is not installed
    IMPORT_ERROR = exc
else:
    AVAILABLE = True
    SecondaryTierManager = _tiering.SecondaryTierManager
    JobResult = _tiering.JobResult
    LookupResult = _base.LookupResult
    Locality = _base.Locality
    RequestOffloadingContext = _base.RequestOffloadingContext
    CacheHitSource = _hits.CacheHitSource
    OffloadingConnectorStats = _stats.OffloadingConnectorStats
    OffloadingCounterMetadata = _base.OffloadingCounterMetadata
    OffloadingGaugeMetadata = _base.OffloadingGaugeMetadata
