"""Model layout: envelope sizes against hand arithmetic, field placement, TP, fingerprints."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore.layout import (
    ENVELOPE_ALIGN,
    Envelope,
    LayoutError,
    ModelLayout,
    layout_from_config,
    load_config,
    load_preset,
    preset_names,
)

BF16, F32 = 2, 4  # bytes per element


def tiny_config(**changes: Any) -> dict[str, Any]:
    """The reference model's shape: 3 full + 1 sliding + 2 linear layers, tiny dims."""
    config: dict[str, Any] = {
        "model_type": "tiny_hybrid",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 6,
        "layer_types": [
            "full_attention", "linear_attention", "sliding_attention",
            "full_attention", "linear_attention", "full_attention",
        ],
        "sliding_window": 40,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 4,
        "linear_num_value_heads": 3,
        "linear_value_head_dim": 5,
        "linear_conv_kernel_dim": 4,
    }
    config.update(changes)
    return config


def mamba_config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-*M",
        "num_key_value_heads": 2,
        "attention_head_dim": 8,
        "mamba_num_heads": 4,
        "mamba_head_dim": 3,
        "n_groups": 2,
        "ssm_state_size": 5,
        "conv_kernel": 4,
    }
    config.update(changes)
    return config


def check_sizes(env: Envelope | None, raw: int, aligned: int) -> None:
    assert env is not None
    assert env.raw_nbytes == raw
    assert env.nbytes == aligned
    assert env.nbytes % ENVELOPE_ALIGN == 0


# --- presets against hand arithmetic --------------------------------------------------------


def test_preset_names_cover_the_five_models() -> None:
    assert {"qwen3-next-80b-a3b", "nemotron-h-8b", "gpt-oss-20b", "nemotron-nano-9b-v2",
            "falcon-h1-1.5b"} <= set(preset_names())


def test_qwen3_next_preset_sizes() -> None:
    layout = load_preset("qwen3-next-80b-a3b")
    assert layout.full_layers == tuple(range(3, 48, 4))
    assert len(layout.recurrent_layers) == 36
    assert layout.swa is None and layout.swa_window_pages() == 0
    # 64 tokens x 12 full layers x (K, V) x 2 kv heads x 256 head dim x bf16
    kv = 64 * 12 * 2 * 2 * 256 * BF16
    check_sizes(layout.kv, kv, kv)
    assert kv == 1_572_864
    # per linear layer: conv (2*16*128 + 32*128) x (4 - 1) in bf16, state 32 x 128 x 128 in fp32
    conv = (2 * 16 * 128 + 32 * 128) * (4 - 1) * BF16
    ssm = 32 * 128 * 128 * F32
    check_sizes(layout.state, 36 * (conv + ssm), 36 * (conv + ssm))
    assert 36 * (conv + ssm) == 77_266_944
    assert layout.state is not None
    assert layout.state.field("conv.0").shape == (8192, 3)
    assert layout.state.field("ssm.46").shape == (32, 128, 128)
    assert layout.state.field("ssm.46").dtype == torch.float32


def test_nemotron_h_preset_sizes() -> None:
    layout = load_preset("nemotron-h-8b")
    assert layout.full_layers == (7, 18, 29, 40)
    assert len(layout.recurrent_layers) == 24
    # 64 tokens x 4 attention layers x (K, V) x 8 kv heads x 128 head dim x bf16
    kv = 64 * 4 * 2 * 8 * 128 * BF16
    check_sizes(layout.kv, kv, kv)
    assert kv == 1_048_576
    # per Mamba2 layer: conv (128*64 + 2*8*128) x 3 in bf16, SSM 128 x 64 x 128 in fp32
    conv = (128 * 64 + 2 * 8 * 128) * 3 * BF16
    ssm = 128 * 64 * 128 * F32
    check_sizes(layout.state, 24 * (conv + ssm), 24 * (conv + ssm))
    assert 24 * (conv + ssm) == 102_137_856


def test_gpt_oss_preset_sizes() -> None:
    layout = load_preset("gpt-oss-20b")
    assert layout.swa_layers == tuple(range(0, 24, 2))
    assert layout.full_layers == tuple(range(1, 24, 2))
    assert layout.state is None
    # 64 tokens x 12 layers x (K, V) x 8 kv heads x 64 head dim x bf16, for each kind
    size = 64 * 12 * 2 * 8 * 64 * BF16
    check_sizes(layout.kv, size, size)
    check_sizes(layout.swa, size, size)
    assert layout.sliding_window == 128
    assert layout.swa_window_pages() == 2  # 128 / 64
    assert load_preset("gpt-oss-20b", page_size=48).swa_window_pages() == 3  # ceil(128 / 48)


def test_nemotron_nano_9b_v2_preset_sizes() -> None:
    layout = load_preset("nemotron-nano-9b-v2")
    assert layout.full_layers == (14, 21, 30, 39)  # the four '*' of the pattern
    assert len(layout.recurrent_layers) == 27  # its 'M's; the 25 '-' keep nothing
    # 64 tokens x 4 attention layers x (K, V) x 8 kv heads x 128 head dim x bf16
    kv = 64 * 4 * 2 * 8 * 128 * BF16
    check_sizes(layout.kv, kv, kv)
    assert kv == 1_048_576
    # per Mamba2 layer: conv (128*80 + 2*8*128) x 3 in bf16, SSM 128 x 80 x 128 in fp32
    conv = (128 * 80 + 2 * 8 * 128) * 3 * BF16
    ssm = 128 * 80 * 128 * F32
    check_sizes(layout.state, 27 * (conv + ssm), 27 * (conv + ssm))
    assert 27 * (conv + ssm) == 143_548_416


def test_falcon_h1_preset_sizes() -> None:
    layout = load_preset("falcon-h1-1.5b")
    # every layer runs attention and Mamba2 side by side: each keeps KV *and* state
    assert layout.full_layers == layout.recurrent_layers == tuple(range(24))
    # 64 tokens x 24 layers x (K, V) x 2 kv heads x 128 head dim x bf16
    kv = 64 * 24 * 2 * 2 * 128 * BF16
    check_sizes(layout.kv, kv, kv)
    assert kv == 1_572_864
    # per layer: conv (48*64 + 2*1*256) x 3 in bf16, SSM 48 x 64 x 256 in fp32
    conv = (48 * 64 + 2 * 1 * 256) * 3 * BF16
    ssm = 48 * 64 * 256 * F32
    check_sizes(layout.state, 24 * (conv + ssm), 24 * (conv + ssm))
    assert 24 * (conv + ssm) == 76_013_568
    assert layout.state is not None
    assert layout.state.field("conv.23").shape == (3584, 3)


def test_preset_overrides_and_unknown_name() -> None:
    layout = load_preset("gpt-oss-20b", page_size=16, kv_dtype=torch.float8_e4m3fn)
    assert layout.kv is not None
    assert layout.kv.raw_nbytes == 16 * 12 * 2 * 8 * 64 * 1
    with pytest.raises(LayoutError, match="no-such-model"):
        load_preset("no-such-model")


def test_presets_hold_a_source_repo() -> None:
    root = Path(__file__).resolve().parents[2] / "tierstore" / "presets"
    for name in preset_names():
        data = json.loads((root / f"{name}.json").read_text())
        assert data["name"] == name
        assert "/" in data["source"]


# --- the generic layer_types form -----------------------------------------------------------


def test_generic_tiny_model_sizes_and_alignment() -> None:
    layout = layout_from_config(tiny_config(), page_size=4)
    assert layout.full_layers == (0, 3, 5)
    assert layout.swa_layers == (2,)
    assert layout.recurrent_layers == (1, 4)
    kv_raw = 4 * 3 * 2 * 2 * 8 * BF16  # 768
    check_sizes(layout.kv, kv_raw, 768)
    swa_raw = 4 * 1 * 2 * 2 * 8 * BF16  # 256
    check_sizes(layout.swa, swa_raw, 256)
    # conv: (2*2*4 + 3*5) x 3 bf16 = 186 bytes, padded to 192 before fp32 state 3 x 4 x 5 = 240
    layer = 192 + 240  # 432, already a multiple of 16
    check_sizes(layout.state, layer + 192 + 240, 1024)
    assert layout.state is not None
    assert [f.offset for f in layout.state.fields] == [0, 192, 432, 624]
    assert layout.swa_window_pages() == 10  # 40 tokens / 4 per page


def test_generic_with_mamba_and_linear_layers() -> None:
    config = tiny_config(layer_types=["mamba", "linear_attention", "full_attention"],
                         num_hidden_layers=3, mamba_num_heads=4, mamba_head_dim=2, n_groups=1,
                         ssm_state_size=3, conv_kernel=2)
    layout = layout_from_config(config)
    assert layout.state is not None
    assert layout.state.field("conv.0").shape == (4 * 2 + 2 * 1 * 3, 1)
    assert layout.state.field("ssm.0").shape == (4, 2, 3)
    assert layout.state.field("conv.1").shape == (2 * 2 * 4 + 3 * 5, 3)


def test_text_config_wrapper_is_unwrapped() -> None:
    inner = tiny_config()
    assert layout_from_config({"model_type": "wrapper", "text_config": inner}).kv is not None


def test_dtypes_follow_config_and_overrides() -> None:
    layout = layout_from_config(tiny_config(torch_dtype="float16", mamba_ssm_dtype="bfloat16"))
    assert layout.kv is not None and layout.state is not None
    assert layout.kv.fields[0].dtype == torch.float16
    assert layout.state.field("conv.1").dtype == torch.float16
    assert layout.state.field("ssm.1").dtype == torch.bfloat16
    plain = layout_from_config(tiny_config(torch_dtype=None))
    assert plain.kv is not None and plain.state is not None
    assert plain.kv.fields[0].dtype == torch.bfloat16
    assert plain.state.field("ssm.1").dtype == torch.float32
    forced = layout_from_config(tiny_config(), kv_dtype=torch.float32,
                                state_dtype=torch.bfloat16, conv_dtype=torch.float32)
    assert forced.kv is not None and forced.state is not None
    assert forced.kv.fields[0].dtype == torch.float32
    assert forced.state.field("ssm.1").dtype == torch.bfloat16
    assert forced.state.field("conv.1").dtype == torch.float32
    assert layout_from_config(tiny_config(torch_dtype=None, dtype="float32")).kv is not None
    named = layout_from_config(tiny_config(), kv_dtype="torch.float16", state_dtype="bf16")
    assert named.fingerprint == layout_from_config(
        tiny_config(), kv_dtype=torch.float16, state_dtype=torch.bfloat16).fingerprint
    with pytest.raises(LayoutError, match="kv_dtype = 'fp4'"):
        layout_from_config(tiny_config(), kv_dtype="fp4")


# --- field placement ------------------------------------------------------------------------


def test_kv_field_strides_span_all_layers() -> None:
    layout = layout_from_config(tiny_config(), page_size=4)
    assert layout.kv is not None
    row = 2 * 8  # kv heads x head dim, in elements
    k3 = layout.kv.field("k.3")
    assert k3.shape == (4, 2, 8)
    assert k3.strides == (3 * 2 * row, 8, 1)
    assert k3.offset == (2 * 1 + 0) * row * BF16  # layer 3 is the 2nd full layer
    assert layout.kv.field("v.5").offset == (2 * 2 + 1) * row * BF16
    with pytest.raises(KeyError, match=r"k\.1"):
        layout.kv.field("k.1")


def test_kv_view_picks_exactly_the_expected_bytes() -> None:
    layout = layout_from_config(tiny_config(), page_size=4)
    env = layout.kv
    assert env is not None
    buf = torch.arange(env.nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    field = env.field("v.3")
    got = torch.as_strided(buf.view(field.dtype), field.shape, field.strides,
                           field.offset // field.dtype.itemsize)
    # by hand: token t, head h starts at byte t*(3*2*16*2) + (2*1+1)*16*2 + h*8*2
    for t in range(4):
        for h in range(2):
            start = t * (3 * 2 * 16 * BF16) + (2 * 1 + 1) * 16 * BF16 + h * 8 * BF16
            want = buf[start:start + 8 * BF16].view(torch.bfloat16)
            assert torch.equal(got[t, h].view(torch.int16), want.view(torch.int16))
    assert torch.equal(field.view(buf).view(torch.int16), got.view(torch.int16))


@pytest.mark.parametrize("kind", ["kv", "swa", "state"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_fields_fill_envelope_without_overlap(kind: str, tp_size: int) -> None:
    config = tiny_config(num_key_value_heads=4, linear_num_key_heads=2, linear_num_value_heads=4)
    layout = layout_from_config(config, page_size=3, tp_size=tp_size, tp_rank=tp_size - 1)
    env = layout.envelopes()[kind]
    owner = torch.full((env.nbytes,), -1, dtype=torch.int64)
    buf = torch.zeros(env.nbytes, dtype=torch.uint8)
    for index, field in enumerate(env.fields):
        view = field.view(buf)
        assert tuple(view.shape) == field.shape
        view.fill_(1.1)  # 1.1 has no zero byte in bf16, fp16 or fp32
        covered = buf.nonzero().flatten()
        assert bool((owner[covered] == -1).all()), f"{field.name} overlaps another field"
        owner[covered] = index
        buf.zero_()
        start, end = field.span
        assert end <= env.raw_nbytes
        assert int((owner == index).sum()) == field.nbytes
        assert covered.min() >= start and covered.max() < end
    data = sum(f.nbytes for f in env.fields)
    assert int((owner >= 0).sum()) == data
    if kind != "state":
        assert data == env.raw_nbytes  # attention envelopes are dense


def test_view_rejects_short_or_typed_buffers() -> None:
    layout = layout_from_config(tiny_config(), page_size=4)
    assert layout.kv is not None
    field = layout.kv.field("v.5")
    with pytest.raises(LayoutError, match="uint8"):
        field.view(torch.zeros(layout.kv.nbytes, dtype=torch.int16))
    with pytest.raises(LayoutError, match="bytes"):
        field.view(torch.zeros(16, dtype=torch.uint8))


def test_view_over_an_arena_slice() -> None:
    layout = layout_from_config(tiny_config(), page_size=4)
    env = layout.kv
    assert env is not None
    arena = torch.zeros(3 * env.nbytes, dtype=torch.uint8)
    slot = arena[env.nbytes:2 * env.nbytes]
    env.field("k.0").view(slot).fill_(1.0)
    assert int(arena[: env.nbytes].sum()) == 0 and int(arena[2 * env.nbytes:].sum()) == 0
    assert int(slot.count_nonzero()) > 0


# --- tensor parallelism ---------------------------------------------------------------------


def test_tp_divides_heads() -> None:
    one = load_preset("qwen3-next-80b-a3b")
    two = load_preset("qwen3-next-80b-a3b", tp_size=2, tp_rank=1)
    assert one.kv is not None and two.kv is not None
    assert two.kv.raw_nbytes == one.kv.raw_nbytes // 2
    assert two.kv.field("k.3").shape == (64, 1, 256)
    assert two.state is not None
    assert two.state.field("conv.0").shape == ((2 * 8 * 128 + 16 * 128), 3)
    assert two.state.field("ssm.0").shape == (16, 128, 128)
    nemo = load_preset("nemotron-h-8b", tp_size=4, tp_rank=3)
    assert nemo.state is not None
    assert nemo.state.field("conv.0").shape == (32 * 64 + 2 * 2 * 128, 3)
    assert nemo.state.field("ssm.0").shape == (32, 64, 128)


def test_tp_rejects_indivisible_heads() -> None:
    with pytest.raises(LayoutError, match="num_key_value_heads"):
        load_preset("qwen3-next-80b-a3b", tp_size=4)  # 2 kv heads
    with pytest.raises(LayoutError, match="n_groups"):
        layout_from_config(mamba_config(n_groups=1), tp_size=2)
    with pytest.raises(LayoutError, match="linear_num_value_heads"):
        layout_from_config(tiny_config(num_key_value_heads=4, linear_num_key_heads=2), tp_size=2)
    with pytest.raises(LayoutError, match="tp_rank"):
        layout_from_config(tiny_config(), tp_size=2, tp_rank=2)
    with pytest.raises(LayoutError, match="tp_size"):
        layout_from_config(tiny_config(), tp_size=0)


# --- fingerprint ----------------------------------------------------------------------------


def test_fingerprint_stable_and_sensitive() -> None:
    base = load_preset("qwen3-next-80b-a3b")
    assert base.fingerprint == load_preset("qwen3-next-80b-a3b").fingerprint
    assert base.fingerprint == layout_from_config(
        json.loads(json.dumps(_preset_config("qwen3-next-80b-a3b")))).fingerprint
    assert len(base.fingerprint) == 64
    int(base.fingerprint, 16)
    changed = [
        load_preset("qwen3-next-80b-a3b", page_size=32),
        load_preset("qwen3-next-80b-a3b", kv_dtype=torch.float16),
        load_preset("qwen3-next-80b-a3b", state_dtype=torch.bfloat16),
        load_preset("qwen3-next-80b-a3b", tp_size=2, tp_rank=0),
        load_preset("qwen3-next-80b-a3b", tp_size=2, tp_rank=1),
        load_preset("qwen3-next-80b-a3b", name="another-model"),
    ]
    prints = {base.fingerprint} | {layout.fingerprint for layout in changed}
    assert len(prints) == len(changed) + 1


def test_fingerprints_of_existing_presets_do_not_move() -> None:
    """Page keys fold in the fingerprint: a changed one orphans what Redis already holds."""
    assert load_preset("qwen3-next-80b-a3b").fingerprint.startswith("257706bf1d44ae1d")
    assert load_preset("nemotron-h-8b").fingerprint.startswith("671de5c1764de7e9")
    assert load_preset("gpt-oss-20b").fingerprint.startswith("c88b6929bb69f73b")


def _preset_config(name: str) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2] / "tierstore" / "presets"
    return dict(json.loads((root / f"{name}.json").read_text()))


def test_layout_is_frozen() -> None:
    layout = load_preset("gpt-oss-20b")
    assert isinstance(layout, ModelLayout)
    with pytest.raises(AttributeError):
        layout.page_size = 32  # type: ignore[misc]


# --- configs we refuse ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "llama", "num_hidden_layers": 2}, "'model_type' = 'llama'"),
        (tiny_config(layer_types=["full_attention", "cross_attention"], num_hidden_layers=2),
         "'cross_attention'"),
        (tiny_config(layer_types=[]), "'layer_types'"),
        (tiny_config(num_hidden_layers=5), "'num_hidden_layers' = 5"),
        (tiny_config(head_dim=0), "'head_dim' = 0"),
        (tiny_config(num_key_value_heads=-2), "'num_key_value_heads' = -2"),
        (tiny_config(linear_key_head_dim=2.5), "'linear_key_head_dim' = 2.5"),
        (tiny_config(linear_conv_kernel_dim=1), "'linear_conv_kernel_dim' = 1"),
        (tiny_config(sliding_window=True), "'sliding_window' = True"),
        (tiny_config(torch_dtype="int4"), "'torch_dtype' = 'int4'"),
        ({k: v for k, v in tiny_config().items() if k != "sliding_window"}, "'sliding_window'"),
        ({k: v for k, v in tiny_config().items() if k != "linear_num_key_heads"},
         "'linear_num_key_heads' is missing"),
        (mamba_config(hybrid_override_pattern="M-X*"), "'X'"),
        ({k: v for k, v in mamba_config().items() if k != "hybrid_override_pattern"},
         "'layers_block_type' and 'hybrid_override_pattern' are both missing"),
        ({k: v for k, v in mamba_config().items() if k != "ssm_state_size"}, "'ssm_state_size'"),
        (mamba_config(hybrid_override_pattern="--"), "none of them keeps a cache"),
        ({"model_type": "qwen3_next", "num_hidden_layers": 4}, "'full_attention_interval'"),
        ({k: v for k, v in tiny_config().items() if k != "head_dim"}, "'hidden_size'"),
    ],
)
def test_rejections_name_key_and_value(config: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(message)):
        layout_from_config(config)


@pytest.mark.parametrize("page_size", [0, -64, 1.5, True, "64"])
def test_rejects_bad_page_size(page_size: Any) -> None:
    with pytest.raises(LayoutError, match="page_size"):
        layout_from_config(tiny_config(), page_size=page_size)


def test_rejects_non_dict_config() -> None:
    with pytest.raises(LayoutError, match="dict"):
        layout_from_config([1, 2])  # type: ignore[arg-type]


def test_head_dim_falls_back_to_hidden_over_heads() -> None:
    config = {k: v for k, v in tiny_config().items() if k != "head_dim"}
    layout = layout_from_config({**config, "hidden_size": 64, "num_attention_heads": 8})
    assert layout.kv is not None and layout.kv.fields[0].shape[-1] == 8
    with pytest.raises(LayoutError, match="not divisible"):
        layout_from_config({**config, "hidden_size": 60, "num_attention_heads": 8})


def test_model_type_defaults_without_layer_types() -> None:
    qwen = layout_from_config({**_preset_config("qwen3-next-80b-a3b"), "num_hidden_layers": 8})
    assert qwen.full_layers == (3, 7) and qwen.recurrent_layers == (0, 1, 2, 4, 5, 6)
    oss = {k: v for k, v in _preset_config("gpt-oss-20b").items() if k != "layer_types"}
    assert layout_from_config(oss).swa_layers == tuple(range(0, 24, 2))
    blocks = {k: v for k, v in mamba_config().items() if k != "hybrid_override_pattern"}
    layout = layout_from_config({**blocks, "layers_block_type": ["mamba", "mlp", "attention"]})
    assert layout.recurrent_layers == (0,) and layout.full_layers == (2,)


def test_load_config_reads_and_rejects(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config()))
    assert load_config(path) == tiny_config()
    assert layout_from_config(load_config(str(path))).kv is not None
    path.write_text("[1, 2]")
    with pytest.raises(LayoutError, match="list"):
        load_config(path)
    path.write_text("{not json")
    with pytest.raises(LayoutError, match="JSON"):
        load_config(path)


# --- every transformers hybrid, in the spellings its configs use ------------------------------

MAMBA2_N = {  # Granite-4.0-H / Bamba / Falcon-H1 field names
    "num_key_value_heads": 2, "hidden_size": 32, "num_attention_heads": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8,
    "mamba_d_conv": 4, "mamba_expand": 2,
}


def recurrent_shapes(layout: ModelLayout) -> dict[str, tuple[int, ...]]:
    assert layout.state is not None
    return {f.name: f.shape for f in layout.state.fields}


@pytest.mark.parametrize("spelling", [
    {"layers_block_type": ["linear_attention", "mlp", "full_attention", "moe"]},  # transformers 5
    {"layers_block_type": ["mamba", "mlp", "attention", "moe"]},  # hub config.json
    {"hybrid_override_pattern": "M-*E"},
])
def test_nemotron_h_spellings_agree(spelling: dict[str, Any]) -> None:
    config = {k: v for k, v in mamba_config().items() if k != "hybrid_override_pattern"}
    layout = layout_from_config({**config, **spelling})
    assert layout.full_layers == (2,) and layout.recurrent_layers == (0,)
    assert recurrent_shapes(layout) == {"conv.0": (4 * 3 + 2 * 2 * 5, 3), "ssm.0": (4, 3, 5)}


@pytest.mark.parametrize("extra", [
    {"mamba_n_heads": 64, "mamba_d_conv": 9, "unrelated_kwarg": [1, 2]},  # Granite-spelled keys
    {"mamba_n_heads": 64},
    {"some_vendor_flag": True, "mamba_d_state": 7},
])
def test_nemotron_h_spelling_follows_model_type(extra: dict[str, Any]) -> None:
    # A config keeps unknown kwargs: keys of the other family's spelling ride along and must
    # neither be read nor make the layout look for the rest of that spelling.
    plain = layout_from_config(mamba_config())
    layout = layout_from_config(mamba_config(**extra))
    assert recurrent_shapes(layout) == recurrent_shapes(plain)
    assert recurrent_shapes(layout)["ssm.0"] == (4, 3, 5)


def test_granite_spelling_follows_model_type() -> None:
    extra = {"mamba_num_heads": 64, "n_groups": 7, "conv_kernel": 2, "unrelated_kwarg": "x"}
    config = {"model_type": "granitemoehybrid", "layer_types": ["mamba"], **MAMBA2_N}
    assert (recurrent_shapes(layout_from_config({**config, **extra}))
            == recurrent_shapes(layout_from_config(config)) == {"conv.0": (96, 3),
                                                                "ssm.0": (4, 16, 8)})


def test_mamba2_spelling_without_model_type_follows_its_keys() -> None:
    layout = layout_from_config({"layer_types": ["mamba"], **MAMBA2_N})
    assert recurrent_shapes(layout)["ssm.0"] == (4, 16, 8)


@pytest.mark.parametrize("types", [["mamba", "attention", "mamba"],  # hub
                                   ["linear_attention", "full_attention", "linear_attention"]])
def test_granite_4_h_layer_types(types: list[str]) -> None:
    layout = layout_from_config({"model_type": "granitemoehybrid", "layer_types": types,
                                 **MAMBA2_N})
    assert layout.full_layers == (1,) and layout.recurrent_layers == (0, 2)
    # conv 4*16 + 2*2*8 channels, kernel 4 - 1; SSM heads x head dim x state
    assert recurrent_shapes(layout)["conv.2"] == (96, 3)
    assert recurrent_shapes(layout)["ssm.2"] == (4, 16, 8)
    default = layout_from_config({"model_type": "granitemoehybrid", "num_hidden_layers": 2,
                                  **MAMBA2_N})
    assert default.recurrent_layers == (0, 1) and default.kv is None


def test_bamba_attention_indices_and_auto_head_dim() -> None:
    config = {"model_type": "bamba", "num_hidden_layers": 4, "attn_layer_indices": [1, 3],
              **MAMBA2_N, "mamba_d_head": "auto"}
    layout = layout_from_config(config)
    assert layout.full_layers == (1, 3) and layout.recurrent_layers == (0, 2)
    assert recurrent_shapes(layout)["ssm.0"] == (4, 2 * 32 // 4, 8)  # expand*hidden / heads


def test_falcon_h1_every_layer_keeps_kv_and_state() -> None:
    layout = layout_from_config({"model_type": "falcon_h1", "num_hidden_layers": 3,
                                 "head_dim": 8, **MAMBA2_N, "mamba_d_ssm": 64})
    assert layout.full_layers == layout.recurrent_layers == (0, 1, 2)
    assert layout.kv is not None and layout.kv.field("k.2").shape == (64, 2, 8)
    listed = layout_from_config({"model_type": "falcon_h1", "head_dim": 8, **MAMBA2_N,
                                 "layers_block_type": ["hybrid", "hybrid"]})
    assert listed.full_layers == listed.recurrent_layers == (0, 1)


def test_jamba_mamba1_state() -> None:
    config = {"model_type": "jamba", "num_hidden_layers": 4, "attn_layer_period": 2,
              "attn_layer_offset": 1, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "mamba_expand": 2, "mamba_d_state": 8,
              "mamba_d_conv": 4}
    layout = layout_from_config(config)
    assert layout.full_layers == (1, 3) and layout.recurrent_layers == (0, 2)
    # Mamba-1: conv (expand * hidden, kernel - 1), SSM (expand * hidden, d_state)
    assert recurrent_shapes(layout) == {"conv.0": (64, 3), "ssm.0": (64, 8),
                                        "conv.2": (64, 3), "ssm.2": (64, 8)}
    assert layout_from_config(config, tp_size=2).state.field("ssm.0").shape == (32, 8)  # type: ignore[union-attr]


def test_lfm2_short_conv_keeps_only_conv_state() -> None:
    base = {"model_type": "lfm2", "num_hidden_layers": 3, "hidden_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 3}
    for spelling in ({"full_attn_idxs": [1]},
                     {"layer_types": ["conv", "full_attention", "conv"]}):
        layout = layout_from_config({**base, **spelling})
        assert layout.full_layers == (1,) and layout.recurrent_layers == (0, 2)
        assert recurrent_shapes(layout) == {"conv.0": (32, 2), "conv.2": (32, 2)}
        # (32 x 2) bf16 = 128 bytes, then the next field 16-aligned: 256 in all
        check_sizes(layout.state, 256, 256)


def test_qwen3_5_text_config_and_defaults() -> None:
    text = {**_preset_config("qwen3-next-80b-a3b"), "model_type": "qwen3_5_text",
            "num_hidden_layers": 8}
    del text["name"], text["source"]
    layout = layout_from_config({"model_type": "qwen3_5", "text_config": text})
    assert layout.full_layers == (3, 7)
    assert recurrent_shapes(layout)["ssm.0"] == (32, 128, 128)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "kimi_linear", "layer_types": ["linear_attention"]},
         "'model_type' = 'kimi_linear'"),
        (tiny_config(layer_types=["chunked_attention"], num_hidden_layers=1),
         "'chunked_attention'"),
        ({"model_type": "bamba", "num_hidden_layers": 2, "attn_layer_indices": [5], **MAMBA2_N},
         "'attn_layer_indices' = [5]"),
        ({"model_type": "jamba", "num_hidden_layers": 2, "attn_layer_period": 2},
         "'attn_layer_offset' = None"),
        ({"model_type": "lfm2", "num_hidden_layers": 1, "layer_types": ["conv"],
          "hidden_size": 8}, "'conv_L_cache' is missing"),
        ({"model_type": "granitemoehybrid", "layer_types": ["mamba"],
          **{k: v for k, v in MAMBA2_N.items() if k != "mamba_d_state"}},
         "'mamba_d_state' is missing"),
        ({"model_type": "bamba", "num_hidden_layers": 1, "attn_layer_indices": [],
          **MAMBA2_N, "mamba_d_head": "auto", "mamba_n_heads": 5},
         "'mamba_d_head' = 'auto'"),
        ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-X*"}, "'X'"),
    ],
)
def test_hybrid_rejections_name_the_key(config: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(message)):
        layout_from_config(config)
