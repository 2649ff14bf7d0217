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

from tierstore.architectures import (
    LayerCache,
    LayoutError,
    Recurrent,
    divide,
    layer_caches,
    positive,
    recurrent_fields,
)

__all__ = [
    "ENVELOPE_ALIGN", "Envelope", "Field", "LayoutError", "ModelLayout",
    "layout_from_config", "load_config", "load_preset", "preset_names",
]

ENVELOPE_ALIGN = 256  # envelope sizes round up to this so batched copies stay vector-wide
_FIELD_ALIGN = 16  # state fields start 16-byte aligned so per-layer kernels get vector loads

EnvelopeKind = Literal["kv", "swa", "state"]

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


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


def _head_dim(config: dict[str, Any]) -> int:
    for key in ("head_dim", "attention_head_dim"):
        if config.get(key) is not None:
            return positive(config, key, "attention head size")
    hidden = positive(config, "hidden_size", "attention head size (no head_dim)")
    heads = positive(config, "num_attention_heads", "attention head size (no head_dim)")
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


def _state_envelope(
    config: dict[str, Any], layers: Sequence[tuple[int, Recurrent]], tp_size: int,
    conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
) -> Envelope | None:
    """Each recurrent layer's conv state then SSM state (short-conv layers have none),
    contiguous, 16-byte aligned fields."""
    if not layers:
        return None
    fields: list[Field] = []
    offset = 0
    for layer, flavour in layers:
        conv, ssm = recurrent_fields(config, flavour, tp_size)
        for name, shape, dtype in (("conv", conv, conv_dtype), ("ssm", ssm, ssm_dtype)):
            if shape is None:
                continue
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

    layers: list[LayerCache] = layer_caches(config)
    full = tuple(i for i, c in enumerate(layers) if c.attention == "full")
    swa = tuple(i for i, c in enumerate(layers) if c.attention == "swa")
    recurrent = [(i, c.recurrent) for i, c in enumerate(layers) if c.recurrent is not None]
    if not (full or swa or recurrent):
        raise LayoutError(f"config describes {len(layers)} layers and none of them keeps a cache")

    kv_env = swa_env = None
    if full or swa:
        kv_heads = divide(config, "num_key_value_heads", tp_size, "attention KV")
        head_dim = _head_dim(config)
        kv_env = _attention_envelope("kv", full, kv_heads, head_dim, page_size, cache_dtype)
        swa_env = _attention_envelope("swa", swa, kv_heads, head_dim, page_size, cache_dtype)
    window = positive(config, "sliding_window", "sliding-window layers") if swa else None
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
