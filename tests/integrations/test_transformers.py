"""Real transformers model code as the client (tiny random configs, CPU, float32).

For every hybrid architecture transformers ships: the layout matches the cache tensors the real
implementation keeps, and the logits of a prompt continued from a prefix restored out of
tierstore equal those of a full recompute — on an L1 hit, after compaction moved the blocks,
promoted from the host tier (L2), from Redis (L3) and through the HTTP service.

Two comparisons per run. *Exact*: the restored continuation is bit-identical to transformers
continuing its own live cache over the same chunks (so the store returned exactly the state the
model had). *Recompute*: it is within ``TOLERANCE`` of one forward over the whole prompt; that
bound is transformers' own cache-vs-recompute difference, not the store's (float32 reduction
order; Bamba's cached attention path alone differs by ~1e-3, with or without tierstore).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import transformers as tf

from remote_tier import RemoteTierConfig
from tierstore.client import Client
from tierstore.config import StoreConfig
from tierstore.integrations.transformers import (
    CacheCodec,
    CacheMismatchError,
    Envelopes,
    LibraryBackend,
    PrefixBackend,
    PrefixCache,
    ServiceBackend,
    model_layout,
)
from tierstore.layout import ModelLayout, layout_from_config
from tierstore.service.config import ServiceConfig
from tierstore.store import TierStore
from tierstore.testing.service import RunningService, free_port

PAGE = 4
VOCAB = 101
BASE: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                        "num_attention_heads": 4, "num_key_value_heads": 2}
MAMBA2: dict[str, Any] = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2,
                          "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 8}
GDN: dict[str, Any] = {"num_hidden_layers": 4, "full_attention_interval": 2, "head_dim": 8,
                       "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                       "linear_num_value_heads": 4, "linear_value_head_dim": 8,
                       "linear_conv_kernel_dim": 4}

# name -> (tiny config, how the hub's config.json spells the same model)
ARCHS: dict[str, tuple[Callable[[], Any], Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "qwen3_next": (lambda: tf.Qwen3NextConfig(
        **BASE, **GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16), lambda d: d),
    "qwen3_5": (lambda: tf.Qwen3_5TextConfig(**BASE, **GDN),
                lambda d: {"model_type": "qwen3_5", "text_config": d}),
    "qwen3_5_moe": (lambda: tf.Qwen3_5MoeTextConfig(
        **BASE, **GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16),
        lambda d: {"model_type": "qwen3_5_moe", "text_config": d}),
    "gpt_oss": (lambda: tf.GptOssConfig(**BASE, num_hidden_layers=4, head_dim=8,
                                        sliding_window=8, num_local_experts=4,
                                        num_experts_per_tok=2), lambda d: d),
    "nemotron_h": (lambda: tf.NemotronHConfig(
        **BASE, head_dim=8, layers_block_type=["linear_attention", "mlp", "full_attention",
                                               "linear_attention"],
        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4,
        chunk_size=8),
        lambda d: {**{k: v for k, v in d.items() if k != "layers_block_type"},
                   "hybrid_override_pattern": "M-*M"}),
    "falcon_h1": (lambda: tf.FalconH1Config(**BASE, num_hidden_layers=3, head_dim=8,
                                            **{**MAMBA2, "mamba_d_head": 8}, mamba_d_ssm=32),
                  lambda d: d),
    "granitemoehybrid": (lambda: tf.GraniteMoeHybridConfig(
        **BASE, **MAMBA2, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_local_experts=4, num_experts_per_tok=2),
        lambda d: {**d, "layer_types": ["mamba", "attention", "mamba", "attention"]}),
    "bamba": (lambda: tf.BambaConfig(**BASE, **MAMBA2, num_hidden_layers=4,
                                     attn_layer_indices=[1, 3]), lambda d: d),
    "jamba": (lambda: tf.JambaConfig(**BASE, num_hidden_layers=4, attn_layer_period=2,
                                     attn_layer_offset=1, expert_layer_period=2,
                                     expert_layer_offset=1, num_experts=2, mamba_d_state=8,
                                     mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4),
              lambda d: d),
    "lfm2": (lambda: tf.Lfm2Config(**BASE, num_hidden_layers=4, full_attn_idxs=[1, 3],
                                   conv_L_cache=3),
             lambda d: {k: v for k, v in d.items() if k != "layer_types"}),
    "lfm2_moe": (lambda: tf.Lfm2MoeConfig(
        **BASE, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv",
                                                  "full_attention"],
        conv_L_cache=3, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16), lambda d: d),
}
TOLERANCE = {"bamba": 2e-3, "jamba": 1e-4}  # see the module docstring; 1e-5 otherwise
PROMPT, SHARED, SECOND = 21, 20, 27  # first prompt, its cached prefix, the second prompt
IDLE_S = 0.4  # how long prompts cached before the target sit idle (the compaction path)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for this module: the tensors are tiny, threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def model(arch: str, dtype: torch.dtype = torch.float32) -> Any:
    """The tiny model, seeded; built once per session."""
    config = ARCHS[arch][0]()
    config.dtype = str(dtype).removeprefix("torch.")
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=g)]


# --- the layout against the cache transformers keeps ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_layout_matches_the_cache_transformers_keeps(arch: str, dtype: torch.dtype) -> None:
    m = model(arch, dtype)
    layout = model_layout(m, page_size=PAGE)
    codec = CacheCodec(layout, m.config)
    cache = codec.new_cache()
    with torch.no_grad():
        m(torch.tensor([tokens(12, 1)]), past_key_values=cache)
    kv_layers, state_layers = set(), set()
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            env = layout.kv if i in layout.full_layers else layout.swa
            assert env is not None, f"layer {i} keeps KV the layout lacks"
            want = env.field(f"k.{i}")  # (page, kv heads, head dim)
            for got in (keys, layer.values):
                assert tuple(got.shape) == (1, want.shape[1], 12, want.shape[2])
                assert got.dtype == want.dtype
            kv_layers.add(i)
        conv = (getattr(layer, "conv_states", None) or {}).get(0)
        if conv is not None:
            assert layout.state is not None
            want = layout.state.field(f"conv.{i}")  # engines keep kernel - 1 columns
            assert tuple(conv.shape) == (1, want.shape[0], want.shape[1] + 1)
            assert conv.dtype == want.dtype
            state_layers.add(i)
        ssm = (getattr(layer, "recurrent_states", None) or {}).get(0)
        if ssm is not None:
            assert layout.state is not None
            want = layout.state.field(f"ssm.{i}")
            assert tuple(ssm.shape) == (1, *want.shape) and ssm.dtype == want.dtype
    assert kv_layers == set(layout.full_layers) | set(layout.swa_layers)
    assert state_layers == set(layout.recurrent_layers)
    assert kv_layers or state_layers
    codec.check(cache, 12)
    # A config.json read without overrides gives the same layout: the defaults (KV and conv in
    # the model dtype, SSM state float32) are what transformers keeps, in every spelling.
    plain = m.config.to_dict()
    for spelled in (plain, ARCHS[arch][1](plain)):
        assert layout_from_config(spelled, page_size=PAGE).fingerprint == layout.fingerprint


def test_a_cache_missing_the_window_pages_is_refused() -> None:
    m = model("gpt_oss")
    codec = CacheCodec(model_layout(m, page_size=PAGE), m.config)
    plain = tf.DynamicCache(config=m.config)  # sliding layers keep only window - 1 tokens
    with torch.no_grad():
        m(torch.tensor([tokens(12, 2)]), past_key_values=plain)
    with pytest.raises(CacheMismatchError, match="sliding layer 0 holds 7 of the 8 tokens"):
        codec.encode(plain, 12)
    other = CacheCodec(model_layout(model("lfm2"), page_size=PAGE), model("lfm2").config)
    with pytest.raises(CacheMismatchError, match="layer 0"):
        other.check(plain, 12)


# --- logits on reuse, every path --------------------------------------------------------------


def footprint(layout: ModelLayout) -> int:
    """Bytes one cached prompt of ``SECOND`` tokens can hold in the arena, generously."""
    pages = -(-SECOND // PAGE)
    units = {k: e.nbytes for k, e in layout.envelopes().items()}
    return pages * (units.get("kv", 0) + units.get("swa", 0)) + 2 * units.get("state", 0)


def random_envelopes(layout: ModelLayout, pages: int, seed: int) -> Envelopes:
    g = torch.Generator().manual_seed(seed)

    def rows(kind: str, n: int) -> torch.Tensor | None:
        env = layout.envelopes().get(kind)
        return None if env is None else torch.randint(
            0, 256, (n, env.nbytes), dtype=torch.uint8, generator=g)

    return Envelopes(rows("kv", pages), rows("swa", min(pages, layout.swa_window_pages())),
                     rows("state", 1))


def push_out(store: TierStore, backend: PrefixBackend, target: list[int], seed: int) -> None:
    """Insert other prompts until ``target`` has left L1."""
    for i in range(12):
        if store.peek(target, "tf") == 0:
            return
        fill(store, backend, 1, seed + i)
    raise AssertionError("the target prefix never left L1")


def fill(store: TierStore, backend: PrefixBackend, count: int, seed: int) -> None:
    """Cache ``count`` other prompts (random envelopes)."""
    for i in range(count):
        backend.put(tokens(SHARED, seed + i), random_envelopes(store.layout, SHARED // PAGE, i))


def drop_fillers_and_compact(store: TierStore, backend: PrefixBackend, target: list[int]
                             ) -> None:
    """Drop the prompts cached before ``target`` (they lie further out in every band than its
    blocks, so their holes sit outside them), then compact: the target's blocks move."""
    assert backend.get(target) is not None  # a lookup: the target is the one recently used
    assert store.demote_idle(IDLE_S / 2) > 0  # no L2 / L3: the idle fillers are dropped
    assert store.peek(target, "tf") == SHARED
    store.arena.compact()
    assert store.arena.stats().moves > 0, "compaction moved nothing"
    store.check_integrity()


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    server = request.getfixturevalue("redis_server")
    server.command("FLUSHALL")
    yield str(server.url)


@contextmanager
def served(arch: str, path: str, request: pytest.FixtureRequest
           ) -> Iterator[tuple[PrefixCache, TierStore, str]]:
    """A PrefixCache over a store set up for ``path``; the tier the second prompt must hit."""
    m = model(arch)
    layout = model_layout(m, page_size=PAGE)
    one = footprint(layout)
    if path == "service":
        store = TierStore(layout, StoreConfig(capacity_bytes=64 * one))
        config = ServiceConfig(port=free_port(), kv_host_bytes=1 << 16)
        with RunningService(store, config) as svc, Client(svc.url, retries=0) as client:
            yield PrefixCache(m, ServiceBackend(client, "tf"), layout), store, "l1"
        return
    kwargs: dict[str, Any] = {"capacity_bytes": 64 * one}
    if path == "compacted":
        kwargs["capacity_bytes"] = 4 * one
    elif path == "l2":
        kwargs.update(capacity_bytes=2 * one, host_capacity_bytes=64 * one)
    elif path == "l3":
        kwargs.update(capacity_bytes=2 * one, remote=RemoteTierConfig(
            url=request.getfixturevalue("redis_url"), key_prefix=f"tf-{arch}"))
    store = TierStore(layout, StoreConfig(**kwargs))
    try:
        yield PrefixCache(m, LibraryBackend(store, "tf"), layout), store, \
            "l1" if path in ("l1", "compacted") else path
    finally:
        store.close()


@functools.cache
def references(arch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the second prompt from ``SHARED`` on: transformers continuing its own live
    cache over the chunks a restored run computes (``[SHARED, cut)``, then the rest), and one
    forward over the whole prompt."""
    m = model(arch)
    ids = torch.tensor([second_prompt()])
    cut = SECOND // PAGE * PAGE
    with torch.no_grad():
        live = CacheCodec(model_layout(m, page_size=PAGE), m.config).new_cache()
        m(ids[:, :SHARED], past_key_values=live)
        own = torch.cat([m(ids[:, SHARED:cut], past_key_values=live).logits[0],
                         m(ids[:, cut:], past_key_values=live).logits[0]])
        full = m(ids).logits[0, SHARED:]
    return own.float(), full.float()


def first_prompt() -> list[int]:
    return tokens(PROMPT, 10)


def second_prompt() -> list[int]:
    return first_prompt()[:SHARED] + tokens(SECOND - SHARED, 11)


@pytest.mark.parametrize("path", ["l1", "compacted", "l2", "l3", "service"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_restored_prefix_gives_the_logits_of_a_recompute(
        arch: str, path: str, request: pytest.FixtureRequest) -> None:
    p1, p2 = first_prompt(), second_prompt()
    with served(arch, path, request) as (pc, store, tier):
        if path == "compacted":
            fill(store, LibraryBackend(store, "tf"), 3, seed=500)
            time.sleep(IDLE_S)
        first = pc.prefill(p1)
        assert (first.cached_tokens, first.saved_tokens) == (0, SHARED)
        if path == "compacted":
            drop_fillers_and_compact(store, LibraryBackend(store, "tf"), p1[:-1])
        elif path in ("l2", "l3"):
            push_out(store, LibraryBackend(store, "tf"), p1[:-1], seed=100)
            assert store.peek(p1[:-1], "tf", tiers=(int(path[1]),)) == SHARED

        second = pc.prefill(p2)
        assert second.cached_tokens == SHARED
        assert second.saved_tokens == SECOND // PAGE * PAGE
        assert second.tiers.get(tier, 0) > 0, second.tiers
        if path != "service":
            store.check_integrity()

    own, full = references(arch)
    assert torch.equal(second.logits, own), "restored state differs from the model's own"
    tolerance = TOLERANCE.get(arch, 1e-5)
    assert torch.allclose(second.logits, full, atol=tolerance, rtol=0), \
        float((second.logits - full).abs().max())


@pytest.mark.parametrize("arch", ["gpt_oss", "nemotron_h", "lfm2"])
def test_the_prefilled_cache_decodes_on(arch: str) -> None:
    m = model(arch)
    layout = model_layout(m, page_size=PAGE)
    store = TierStore(layout, StoreConfig(capacity_bytes=64 * footprint(layout)))
    pc = PrefixCache(m, LibraryBackend(store), layout)
    pc.prefill(first_prompt())
    out = pc.prefill(second_prompt())
    assert out.cached_tokens == SHARED
    for layer in out.cache.layers:  # sliding layers keep window - 1 tokens again
        if getattr(layer, "is_sliding", False):
            assert layer.keys.shape[-2] == layer.sliding_window - 1 and not layer.record_past
    nxt = int(out.logits[-1].argmax())
    with torch.no_grad():
        step = m(torch.tensor([[nxt]]), past_key_values=out.cache).logits[0, -1]
        full = m(torch.tensor([[*second_prompt(), nxt]])).logits[0, -1]
    assert torch.allclose(step, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("arch", "reused"), [("gpt_oss", 8), ("nemotron_h", 0)])
def test_a_shorter_shared_prefix(arch: str, reused: int) -> None:
    """Without recurrent state a prefix may end at any page, so every SWA page is kept and a
    prompt sharing 10 tokens reuses 8; a hybrid can only resume at a checkpoint (here 20)."""
    m = model(arch)
    layout = model_layout(m, page_size=PAGE)
    store = TierStore(layout, StoreConfig(capacity_bytes=64 * footprint(layout)))
    pc = PrefixCache(m, LibraryBackend(store), layout)
    pc.prefill(first_prompt())
    prompt = first_prompt()[:10] + tokens(9, 12)
    out = pc.prefill(prompt)
    assert out.cached_tokens == reused
    with torch.no_grad():
        full = m(torch.tensor([prompt])).logits[0, reused:]
    assert torch.allclose(out.logits, full, atol=1e-5, rtol=0)
    store.check_integrity()
