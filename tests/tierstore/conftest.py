"""Tiny layouts and stores for the tierstore tests."""

from __future__ import annotations

import pytest

from tierstore.config import StoreConfig
from tierstore.layout import ModelLayout, layout_from_config
from tierstore.store import TierStore

PAGE = 4

HYBRID = {  # full attention + SWA + recurrent: every match rule applies
    "name": "t-hybrid", "torch_dtype": "float32", "num_key_value_heads": 1, "head_dim": 16,
    "sliding_window": 8, "linear_num_key_heads": 1, "linear_key_head_dim": 4,
    "linear_num_value_heads": 1, "linear_value_head_dim": 4, "linear_conv_kernel_dim": 2,
    "layer_types": ["full_attention", "sliding_attention", "linear_attention"],
}
SWA_ONLY = {  # GPT-OSS-like: full + sliding window, no recurrent state
    "name": "t-swa", "torch_dtype": "float32", "num_key_value_heads": 1, "head_dim": 16,
    "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"],
}
FULL_ONLY = {
    "name": "t-full", "torch_dtype": "float32", "num_key_value_heads": 1, "head_dim": 16,
    "layer_types": ["full_attention"],
}


def layout(config: dict) -> ModelLayout:
    return layout_from_config(config, page_size=PAGE)


def store(config: dict = HYBRID, capacity: int = 1 << 20, **kwargs: object) -> TierStore:
    return TierStore(layout(config), StoreConfig(capacity_bytes=capacity, **kwargs))  # type: ignore[arg-type]


@pytest.fixture
def hybrid() -> TierStore:
    return store()


@pytest.fixture
def redis_url(redis_server) -> str:  # type: ignore[no-untyped-def]
    """The session server, emptied for this test."""
    redis_server.command("FLUSHALL")
    return str(redis_server.url)
