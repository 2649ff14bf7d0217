"""tierstore as a vLLM secondary offloading tier (vLLM 0.33's tiering layer).

vLLM loads it by module path, without a fork or patch: in ``--kv-transfer-config``, the
``OffloadingConnector`` with ``"spec_name": "TieringOffloadingSpec"`` and a secondary tier
``{"type": "TierStoreTier", "module_path": "tierstore.integrations.vllm", "url": ...}``.
Importing this package does not need vLLM; constructing the tier does.
"""

from tierstore.integrations.vllm.config import VllmTierConfig, block_key, block_namespace
from tierstore.integrations.vllm.tier import TierStoreTier

__all__ = ["TierStoreTier", "VllmTierConfig", "block_key", "block_namespace"]
