"""Model layout: envelope sizes and per-layer field views derived from a Hugging Face config.

Three envelope kinds (see DESIGN.md, "Data model"):

- ``kv``: one page of full-attention KV for every full-attention layer, packed per token as
  ``[page_size][num_full_layers][2 (K, V)][kv_heads / tp][head_dim]`` in the cache dtype.
- ``swa``: the same packing for the sliding-window layers.
- ``state``: one recurrent-state checkpoint, layer after layer: ``conv.{l}`` then ``ssm.{l}``.

Dtype choices: the KV cache takes ``kv_dtype`` or else the config's ``torch_dtype``/``dtype``
(bfloat16 when absent); conv state takes the model dtype; SSM / recurrent state takes
``state_dtype`` or else ``mamba_ssm_dtype`` from the config, float32 by default, because the
recurrence accumulates over the whole prefix and drifts in 16-bit.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "ENVELOPE_ALIGN", "Envelope", "Field", "LayoutError", "ModelLayout",
    "layout_from_config", "load_config", "load_preset", "preset_names",
]

ENVELOPE_ALIGN = 256  # envelope sizes round up to this so batched copies stay vector-wide
_FIELD_ALIGN = 16  # state fields start 16-byte aligned so per-layer kernels get vector loads

EnvelopeKind = Literal["kv", "swa", "state"]
_LayerKind = Literal["full", "swa", "linear", "mamba", "none"]

_LAYER_TYPES: dict[str, _LayerKind] = {
    "full_attention": "full", "sliding_attention": "swa",
    "linear_attention": "linear", "mamba": "mamba",
}
# Nemotron-H pattern: M = Mamba2, * = attention, - = MLP, E = MoE (the last two hold no cache).
_PATTERN_KINDS: dict[str, _LayerKind] = {"M": "mamba", "*": "full", "-": "none", "E": "none"}
_BLOCK_TYPES: dict[str, _LayerKind] = {
    "mamba": "mamba", "attention": "full", "mlp": "none", "moe": "none",
}
_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


class LayoutError(ValueError):
    """A config (or request) the layout cannot interpret; the message names the key and value."""


@dataclass(frozen=True)
class Field:
    """One tensor inside an envelope: strides in elements of ``dtype``, offset in bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of data the field holds (not its span, which may interleave other fields)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def span(self) -> tuple[int, int]:
        """Byte range ``[start, end)`` the field touches within its envelope."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return self.offset, self.offset + (last + 1) * self.dtype.itemsize

    def view(self, envelope: torch.Tensor) -> torch.Tensor:
        """A strided view of this field over one envelope's bytes (1-D uint8); copies nothing."""
        if envelope.dtype != torch.uint8 or envelope.dim() != 1:
            raise LayoutError(
                f"field {self.name!r} needs a 1-D uint8 envelope, got {envelope.dtype} "
                f"with shape {tuple(envelope.shape)}"
            )
        if envelope.numel() < self.span[1]:
            raise LayoutError(
                f"field {self.name!r} ends at byte {self.span[1]} but the envelope has "
                f"{envelope.numel()} bytes"
            )
        size = self.dtype.itemsize
        usable = envelope[: envelope.numel() // size * size]
        typed = usable.view(self.dtype)
        return typed.as_strided(
            self.shape, self.strides, typed.storage_offset() + self.offset // size
        )


@dataclass(frozen=True)
class Envelope:
    """One envelope kind: its aligned and raw byte sizes and the fields packed inside."""

    kind: EnvelopeKind
    nbytes: int
    raw_nbytes: int
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        """The field called ``name`` (e.g. ``"k.3"``); KeyError when the envelope lacks it."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.kind} envelope has no field {name!r} ({len(self.fields)} fields)")


@dataclass(frozen=True)
class ModelLayout:
    """Everything about a model that fixes the bytes of its cached state, for one TP rank."""

    name: str
    page_size: int
    kv: Envelope | None
    swa: Envelope | None
    state: Envelope | None
    sliding_window: int | None
    full_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    recurrent_layers: tuple[int, ...]
    tp_rank: int
    tp_size: int
    fingerprint: str

    def envelopes(self) -> dict[str, Envelope]:
        """The envelope kinds this model has, keyed by kind, in the order kv, swa, state."""
        found = {"kv": self.kv, "swa": self.swa, "state": self.state}
        return {kind: env for kind, env in found.items() if env is not None}

    def swa_window_pages(self) -> int:
        """Pages needed to cover the sliding window before a page-aligned prefix end."""
        if self.swa is None or self.sliding_window is None:
            return 0
        return -(-self.sliding_window // self.page_size)


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _positive(config: dict[str, Any], key: str, why: str) -> int:
    """The positive int at ``key``; LayoutError naming the key when missing or invalid."""
    if key not in config:
        raise LayoutError(f"config key {key!r} is missing (needed for {why})")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"config key {key!r} = {value!r} must be a positive integer")
    return value


def _divide(total: int, tp_size: int, key: str) -> int:
    if total % tp_size:
        raise LayoutError(f"config key {key!r} = {total} is not divisible by tp_size {tp_size}")
    return total // tp_size


def _dtype(value: object, label: str, default: torch.dtype) -> torch.dtype:
    """A torch dtype from a dtype, a dtype name or None (``default``); LayoutError otherwise."""
    if value is None:
        return default
    if isinstance(value, torch.dtype):
        return value
    text = str(value).removeprefix("torch.")
    if text not in _DTYPES:
        raise LayoutError(f"{label} = {value!r} is not a dtype the layout knows")
    return _DTYPES[text]


def _mapped(config: dict[str, Any], key: str, table: dict[str, _LayerKind]) -> list[_LayerKind]:
    """Map a per-layer list (or pattern string) through ``table``; LayoutError on a stray value."""
    values = config[key]
    if not isinstance(values, (list, str)) or not values:
        raise LayoutError(f"config key {key!r} = {values!r} must be a non-empty list or string")
    for i, value in enumerate(values):
        if not isinstance(value, str) or value not in table:
            raise LayoutError(f"config key {key!r}[{i}] = {value!r} is not one of {sorted(table)}")
    return [table[value] for value in values]


def _layer_kinds(config: dict[str, Any]) -> list[_LayerKind]:
    """Per-layer cache kind, from layer_types, a Nemotron-H pattern or a model-type default."""
    model_type = config.get("model_type")
    kinds: list[_LayerKind]
    if "layer_types" in config:
        kinds = _mapped(config, "layer_types", _LAYER_TYPES)
    elif model_type == "nemotron_h" and "hybrid_override_pattern" in config:
        kinds = _mapped(config, "hybrid_override_pattern", _PATTERN_KINDS)
    elif model_type == "nemotron_h" and "layers_block_type" in config:
        kinds = _mapped(config, "layers_block_type", _BLOCK_TYPES)
    elif model_type == "nemotron_h":
        raise LayoutError("config key 'hybrid_override_pattern' is missing (nemotron_h layers)")
    elif model_type == "qwen3_next":
        n = _positive(config, "num_hidden_layers", "qwen3_next layer types")
        every = _positive(config, "full_attention_interval", "qwen3_next layer types")
        kinds = ["full" if (i + 1) % every == 0 else "linear" for i in range(n)]
    elif model_type == "gpt_oss":
        # The transformers default when a GPT-OSS config omits layer_types: sliding first.
        n = _positive(config, "num_hidden_layers", "gpt_oss layer types")
        kinds = ["swa" if i % 2 == 0 else "full" for i in range(n)]
    else:
        raise LayoutError(f"config key 'model_type' = {model_type!r} is not supported and the "
                          "config has no 'layer_types'")
    declared = config.get("num_hidden_layers")
    if declared is not None and declared != len(kinds):
        raise LayoutError(f"config key 'num_hidden_layers' = {declared!r} disagrees with the "
                          f"{len(kinds)} layers its layer types describe")
    return kinds


def _head_dim(config: dict[str, Any]) -> int:
    for key in ("head_dim", "attention_head_dim"):
        if config.get(key) is not None:
            return _positive(config, key, "attention head size")
    hidden = _positive(config, "hidden_size", "attention head size (no head_dim)")
    heads = _positive(config, "num_attention_heads", "attention head size (no head_dim)")
    if hidden % heads:
        raise LayoutError(f"config key 'hidden_size' = {hidden} is not divisible by "
                          f"'num_attention_heads' = {heads}")
    return hidden // heads


def _attention_envelope(
    kind: EnvelopeKind, layers: Sequence[int], kv_heads: int, head_dim: int, page_size: int,
    dtype: torch.dtype,
) -> Envelope | None:
    """Per token, every layer's K row then V row; a field's token stride spans all layers."""
    if not layers:
        return None
    row = kv_heads * head_dim
    token_stride = len(layers) * 2 * row
    fields = tuple(
        Field(f"{part}.{layer}", dtype, (page_size, kv_heads, head_dim),
              (token_stride, head_dim, 1), (2 * i + j) * row * dtype.itemsize)
        for i, layer in enumerate(layers)
        for j, part in enumerate(("k", "v"))
    )
    raw = page_size * token_stride * dtype.itemsize
    return Envelope(kind, _align(raw, ENVELOPE_ALIGN), raw, fields)


def _recurrent_shapes(
    config: dict[str, Any], kind: _LayerKind, tp_size: int,
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv shape, ssm shape) of one recurrent layer on one TP rank."""
    if kind == "linear":  # Gated DeltaNet, Qwen3-Next field names
        why = "linear-attention state"
        k_heads = _divide(_positive(config, "linear_num_key_heads", why), tp_size,
                          "linear_num_key_heads")
        v_heads = _divide(_positive(config, "linear_num_value_heads", why), tp_size,
                          "linear_num_value_heads")
        k_dim = _positive(config, "linear_key_head_dim", why)
        v_dim = _positive(config, "linear_value_head_dim", why)
        kernel = _positive(config, "linear_conv_kernel_dim", why)
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        ssm: tuple[int, int, int] = (v_heads, k_dim, v_dim)
    else:  # Mamba2, Nemotron-H field names
        why = "Mamba2 state"
        heads = _divide(_positive(config, "mamba_num_heads", why), tp_size, "mamba_num_heads")
        groups = _divide(_positive(config, "n_groups", why), tp_size, "n_groups")
        head_dim = _positive(config, "mamba_head_dim", why)
        d_state = _positive(config, "ssm_state_size", why)
        kernel = _positive(config, "conv_kernel", why)
        conv_dim = heads * head_dim + 2 * groups * d_state
        ssm = (heads, head_dim, d_state)
    if kernel < 2:
        key = "linear_conv_kernel_dim" if kind == "linear" else "conv_kernel"
        raise LayoutError(f"config key {key!r} = {kernel} must be at least 2 to carry state")
    return (conv_dim, kernel - 1), ssm


def _state_envelope(
    config: dict[str, Any], layers: Sequence[tuple[int, _LayerKind]], tp_size: int,
    conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
) -> Envelope | None:
    """Each recurrent layer's conv state then SSM state, contiguous, 16-byte aligned fields."""
    if not layers:
        return None
    fields: list[Field] = []
    offset = 0
    for layer, kind in layers:
        conv, ssm = _recurrent_shapes(config, kind, tp_size)
        for name, shape, dtype in (("conv", conv, conv_dtype), ("ssm", ssm, ssm_dtype)):
            offset = _align(offset, max(_FIELD_ALIGN, dtype.itemsize))
            field = Field(f"{name}.{layer}", dtype, shape, _contiguous_strides(shape), offset)
            fields.append(field)
            offset += field.nbytes
    return Envelope("state", _align(offset, ENVELOPE_ALIGN), offset, tuple(fields))


def _fingerprint(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _envelope_record(env: Envelope | None) -> object:
    if env is None:
        return None
    fields = [[f.name, str(f.dtype), f.shape, f.strides, f.offset] for f in env.fields]
    return {"nbytes": env.nbytes, "raw": env.raw_nbytes, "fields": fields}


def layout_from_config(
    config: dict[str, Any],
    *,
    page_size: int = 64,
    kv_dtype: torch.dtype | str | None = None,
    state_dtype: torch.dtype | str | None = None,
    conv_dtype: torch.dtype | str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    name: str | None = None,
) -> ModelLayout:
    """Derive the layout of one TP rank from a config dict; reads only, raises LayoutError.

    ``kv_dtype`` sets the KV/SWA cache dtype (default: the config's model dtype),
    ``state_dtype`` the SSM / recurrent state (default: ``mamba_ssm_dtype`` or float32) and
    ``conv_dtype`` the conv state (default: the model dtype).
    """
    if not isinstance(config, dict):
        raise LayoutError(f"config must be a dict, got {type(config).__name__}")
    if isinstance(config.get("text_config"), dict):  # multimodal wrappers keep the LM inside
        config = {**config, **config["text_config"]}
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise LayoutError(f"page_size = {page_size!r} must be a positive integer")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size <= 0:
        raise LayoutError(f"tp_size = {tp_size!r} must be a positive integer")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank = {tp_rank!r} must be in [0, {tp_size})")

    dtype_key = "torch_dtype" if config.get("torch_dtype") is not None else "dtype"
    model_dtype = _dtype(config.get(dtype_key), f"config key {dtype_key!r}", torch.bfloat16)
    cache_dtype = _dtype(kv_dtype, "kv_dtype", model_dtype)
    conv_type = _dtype(conv_dtype, "conv_dtype", model_dtype)
    ssm_default = _dtype(config.get("mamba_ssm_dtype"), "config key 'mamba_ssm_dtype'",
                         torch.float32)
    ssm_type = _dtype(state_dtype, "state_dtype", ssm_default)

    kinds = _layer_kinds(config)
    full = tuple(i for i, k in enumerate(kinds) if k == "full")
    swa = tuple(i for i, k in enumerate(kinds) if k == "swa")
    recurrent = [(i, k) for i, k in enumerate(kinds) if k in ("linear", "mamba")]
    if not (full or swa or recurrent):
        raise LayoutError(f"config describes {len(kinds)} layers and none of them keeps a cache")

    kv_env = swa_env = None
    if full or swa:
        total_heads = _positive(config, "num_key_value_heads", "attention KV")
        kv_heads = _divide(total_heads, tp_size, "num_key_value_heads")
        head_dim = _head_dim(config)
        kv_env = _attention_envelope("kv", full, kv_heads, head_dim, page_size, cache_dtype)
        swa_env = _attention_envelope("swa", swa, kv_heads, head_dim, page_size, cache_dtype)
    window = _positive(config, "sliding_window", "sliding-window layers") if swa else None
    state_env = _state_envelope(config, recurrent, tp_size, conv_type, ssm_type)

    label = name or config.get("name") or config.get("_name_or_path") or config.get("model_type")
    label = str(label)
    payload = {
        "name": label, "page_size": page_size, "tp": [tp_rank, tp_size], "window": window,
        "layers": [full, swa, [i for i, _ in recurrent]],
        "kv": _envelope_record(kv_env), "swa": _envelope_record(swa_env),
        "state": _envelope_record(state_env),
    }
    return ModelLayout(
        name=label, page_size=page_size, kv=kv_env, swa=swa_env, state=state_env,
        sliding_window=window, full_layers=full, swa_layers=swa,
        recurrent_layers=tuple(i for i, _ in recurrent), tp_rank=tp_rank, tp_size=tp_size,
        fingerprint=_fingerprint(payload),
    )


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json`` file into a dict; LayoutError when it is not a JSON object."""
    with open(path, encoding="utf-8") as fh:
        try:
            config = json.load(fh)
        except json.JSONDecodeError as exc:
            raise LayoutError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise LayoutError(f"{path}: top level is {type(config).__name__}, expected an object")
    return config


def _preset_dir() -> Any:
    return resources.files("tierstore").joinpath("presets")


def preset_names() -> list[str]:
    """Names of the bundled presets (``tierstore/presets/*.json``), sorted."""
    return sorted(p.name[: -len(".json")] for p in _preset_dir().iterdir()
                  if p.name.endswith(".json"))


def load_preset(name: str, /, **overrides: Any) -> ModelLayout:
    """The layout of a bundled preset; ``overrides`` go to :func:`layout_from_config`."""
    if name not in preset_names():
        raise LayoutError(f"preset {name!r} does not exist; presets: {preset_names()}")
    config = json.loads(_preset_dir().joinpath(f"{name}.json").read_text(encoding="utf-8"))
    overrides.setdefault("name", config.get("name", name))
    return layout_from_config(config, **overrides)
