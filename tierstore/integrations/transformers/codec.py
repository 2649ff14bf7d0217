"""A transformers ``DynamicCache`` to tierstore envelopes and back, for one model layout.

Convention differences between transformers and the envelopes (which follow the engines):

- KV: transformers keeps ``[batch, kv_heads, tokens, head_dim]`` per layer; a ``kv``/``swa``
  envelope holds one page, per token every layer's K row then V row (``layout.py``).
- Sliding-window layers: transformers keeps only the last ``sliding_window - 1`` tokens, but a
  cached prefix needs whole SWA pages covering the window (``ceil(window / page)`` pages), whose
  first page starts before those tokens. :meth:`CacheCodec.new_cache` therefore switches the
  sliding layers to transformers' past recording (they keep every token; attention still sees
  only the window, so logits do not change) and :meth:`CacheCodec.encode` refuses a sliding
  layer that no longer holds its window pages rather than store a page with holes.
- Conv state: transformers keeps ``kernel`` columns, the envelope ``kernel - 1`` (the oldest
  column is never read again); a restored state gets a zero column in front.
- Recurrent (SSM) state: the same tensor without the batch dimension, in the dtype the model
  keeps (float32 in transformers even for a bf16 model, which is also the layout's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from tierstore.layout import Envelope, Field, LayoutError, ModelLayout, layout_from_config

__all__ = ["CacheCodec", "CacheMismatchError", "Envelopes", "model_layout"]


class CacheMismatchError(LayoutError):
    """A transformers cache does not hold what the layout describes (names layer and tensor)."""


@dataclass(frozen=True)
class Envelopes:
    """One cached prefix as envelope bytes: ``kv`` one row per page, ``swa`` the rows of the
    last ``len(swa)`` pages, ``state`` one row (the checkpoint at the prefix end)."""

    kv: torch.Tensor | None
    swa: torch.Tensor | None
    state: torch.Tensor | None


def model_layout(model: Any, *, page_size: int = 16, **overrides: Any) -> ModelLayout:
    """The layout of a transformers model (its decoder config), KV and conv state in the dtype
    of the model's weights; ``overrides`` go to :func:`layout_from_config`."""
    config = model.config.get_text_config(decoder=True).to_dict()
    dtype = next(model.parameters()).dtype
    overrides.setdefault("kv_dtype", dtype)
    overrides.setdefault("conv_dtype", dtype)
    return layout_from_config(config, page_size=page_size, **overrides)


def _pages_view(buf: torch.Tensor, env: Envelope, field: Field) -> torch.Tensor:
    """``[rows, *field.shape]`` strided view of ``field`` across every row of ``buf``."""
    size = field.dtype.itemsize
    typed = buf.view(field.dtype)  # [rows, nbytes / size]; nbytes is 256-aligned
    return typed.as_strided((buf.shape[0], *field.shape), (env.nbytes // size, *field.strides),
                            typed.storage_offset() + field.offset // size)


class CacheCodec:
    """Encodes a batch-1 ``DynamicCache`` of a model at a page-aligned length into envelopes,
    and decodes envelopes into a fresh cache the model continues from. Holds no cache state."""

    def __init__(self, layout: ModelLayout, config: Any) -> None:
        self.layout = layout
        self.config = config  # the transformers config, to build caches with its layer types

    def new_cache(self) -> DynamicCache:
        """An empty cache for the model whose sliding layers keep every token (see above)."""
        cache = DynamicCache(config=self.config)
        for layer in cache.layers:
            if type(layer) is DynamicSlidingWindowLayer:
                layer.activate_past_recording()
        return cache

    def stop_recording(self, cache: DynamicCache) -> None:
        """Turn the sliding layers of a :meth:`new_cache` cache back into transformers' usual
        ones (keeping the last ``window - 1`` tokens), e.g. before a long decode."""
        for layer in cache.layers:
            if type(layer) is DynamicSlidingWindowLayer and layer.record_past:
                keep = layer.sliding_window - 1
                keys, values = layer.keys, layer.values
                if keys is not None and values is not None and keys.shape[-2] > keep:
                    layer.keys, layer.values = keys[:, :, -keep:, :], values[:, :, -keep:, :]
                layer.record_past = False

    # ------------------------------------------------------------------ checks
    def check(self, cache: DynamicCache, n_tokens: int) -> None:
        """Raise CacheMismatchError unless ``cache`` holds ``n_tokens`` tokens with exactly the
        tensors the layout describes (shapes, dtypes) and no other cached state."""
        page = self.layout.page_size
        described = set(self.layout.full_layers) | set(self.layout.swa_layers)
        for i, layer in enumerate(cache.layers):
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.numel() and i not in described:
                raise CacheMismatchError(f"layer {i} keeps KV the layout does not describe")
            for attr in ("conv_states", "recurrent_states"):
                states = getattr(layer, attr, None) or {}
                if any(t is not None for t in states.values()) and \
                        i not in self.layout.recurrent_layers:
                    raise CacheMismatchError(f"layer {i} keeps {attr} the layout does not "
                                             "describe")
        for kind, layers in (("kv", self.layout.full_layers), ("swa", self.layout.swa_layers)):
            env = self.layout.envelopes().get(kind)
            for i in layers:
                assert env is not None
                want = env.field(f"k.{i}")
                for part in ("keys", "values"):
                    got = _tensor(cache, i, part)
                    held = got.shape[2] if kind == "swa" else n_tokens
                    _same(f"layer {i} {part}", got, (1, want.shape[1], held, want.shape[2]),
                          want.dtype)
        if self.layout.swa_layers and n_tokens % page == 0:
            need = min(n_tokens, self.layout.swa_window_pages() * page)
            for i in self.layout.swa_layers:
                held = _tensor(cache, i, "keys").shape[2]
                if held < need or _layer(cache, i).cumulative_length != n_tokens:
                    raise CacheMismatchError(
                        f"sliding layer {i} holds {held} of the {need} tokens its window pages "
                        f"need at {n_tokens} (build the cache with CacheCodec.new_cache)")
        state = self.layout.state
        for i in self.layout.recurrent_layers:
            assert state is not None
            conv = state.field(f"conv.{i}")
            got = _state(cache, i, "conv_states")
            _same(f"layer {i} conv state", got, (1, conv.shape[0], conv.shape[1] + 1), conv.dtype)
            if f"ssm.{i}" in {f.name for f in state.fields}:
                ssm = state.field(f"ssm.{i}")
                _same(f"layer {i} recurrent state", _state(cache, i, "recurrent_states"),
                      (1, *ssm.shape), ssm.dtype)

    # ------------------------------------------------------------------ encode
    def encode(self, cache: DynamicCache, n_tokens: int) -> Envelopes:
        """The envelopes of the first ``n_tokens`` (page-aligned, all of ``cache``): every KV
        page, the SWA pages of the window before ``n_tokens`` (without recurrent state, where a
        prefix can end at any page, every SWA page the cache still holds) and the recurrent
        checkpoint."""
        page = self.layout.page_size
        if n_tokens <= 0 or n_tokens % page:
            raise LayoutError(f"n_tokens = {n_tokens} must be a positive multiple of the page "
                              f"size {page}")
        self.check(cache, n_tokens)
        pages = n_tokens // page
        kv = swa = state = None
        if self.layout.kv is not None:
            kv = self._encode_attention(cache, self.layout.kv, self.layout.full_layers, pages, 0)
        if self.layout.swa is not None:
            first = max(0, pages - self.layout.swa_window_pages())
            if self.layout.state is None:  # a match may end at any page: keep all SWA pages held
                held = min(_tensor(cache, i, "keys").shape[2] for i in self.layout.swa_layers)
                first = min(first, pages - held // page)
            swa = self._encode_attention(cache, self.layout.swa, self.layout.swa_layers,
                                         pages - first, n_tokens - first * page)
        if self.layout.state is not None:
            state = torch.zeros(1, self.layout.state.nbytes, dtype=torch.uint8)
            for i in self.layout.recurrent_layers:
                conv = self.layout.state.field(f"conv.{i}")
                conv.view(state[0]).copy_(_state(cache, i, "conv_states")[0, :, 1:])
                if f"ssm.{i}" in {f.name for f in self.layout.state.fields}:
                    ssm = self.layout.state.field(f"ssm.{i}")
                    ssm.view(state[0]).copy_(_state(cache, i, "recurrent_states")[0])
        return Envelopes(kv, swa, state)

    def _encode_attention(self, cache: DynamicCache, env: Envelope, layers: Sequence[int],
                          pages: int, tokens_back: int) -> torch.Tensor:
        """Rows for ``pages`` pages; the last ``tokens_back`` tokens each layer holds (all of
        them when 0) are laid out from the first row's first token."""
        page = self.layout.page_size
        buf = torch.zeros(pages, env.nbytes, dtype=torch.uint8)
        for i in layers:
            for part, name in (("keys", "k"), ("values", "v")):
                held = _tensor(cache, i, part)[0]  # [heads, tokens, head_dim]
                held = held[:, held.shape[1] - tokens_back:] if tokens_back else held
                rows = held.transpose(0, 1).reshape(pages, page, *held.shape[::2])
                _pages_view(buf, env, env.field(f"{name}.{i}")).copy_(rows)
        return buf

    # ------------------------------------------------------------------ decode
    def decode(self, envelopes: Envelopes, n_tokens: int, device: torch.device | str = "cpu"
               ) -> DynamicCache:
        """A fresh cache holding the prefix of ``n_tokens`` tokens the envelopes describe."""
        page = self.layout.page_size
        if n_tokens <= 0 or n_tokens % page:
            raise LayoutError(f"n_tokens = {n_tokens} must be a positive multiple of the page "
                              f"size {page}")
        cache = self.new_cache()
        pages = n_tokens // page
        for kind, layers in (("kv", self.layout.full_layers), ("swa", self.layout.swa_layers)):
            env = self.layout.envelopes().get(kind)
            rows = envelopes.kv if kind == "kv" else envelopes.swa
            if env is None:
                continue
            want = pages if kind == "kv" else min(pages, self.layout.swa_window_pages())
            short = len(rows) != want if kind == "kv" else len(rows) < want  # type: ignore[arg-type]
            if rows is None or rows.shape[1:] != (env.nbytes,) or short:
                got = None if rows is None else tuple(rows.shape)
                raise CacheMismatchError(f"{kind} envelopes: expected ({want}, {env.nbytes}) "
                                         f"for {n_tokens} tokens, got {got}")
            rows = rows[len(rows) - want:]  # SWA: the window's pages end the prefix
            for i in layers:
                k, v = (_pages_view(rows, env, env.field(f"{name}.{i}"))
                        .reshape(want * page, *env.field(f"{name}.{i}").shape[1:])
                        .transpose(0, 1).unsqueeze(0).to(device, copy=True).contiguous()
                        for name in ("k", "v"))
                layer = _layer(cache, i)
                layer.update(k, v)
                if kind == "swa":
                    layer.cumulative_length = n_tokens
        state = self.layout.state
        if state is not None:
            if envelopes.state is None or envelopes.state.shape != (1, state.nbytes):
                raise CacheMismatchError(f"state envelope: expected (1, {state.nbytes})")
            row = envelopes.state[0]
            names = {f.name for f in state.fields}
            for i in self.layout.recurrent_layers:
                held = state.field(f"conv.{i}").view(row)
                conv = torch.nn.functional.pad(held, (1, 0)).unsqueeze(0).to(device)
                layer = _layer(cache, i)
                layer.update_conv_state(conv, conv_kernel_size=conv.shape[-1])
                if f"ssm.{i}" in names:
                    ssm = state.field(f"ssm.{i}").view(row).unsqueeze(0).to(device, copy=True)
                    layer.update_recurrent_state(ssm)
        return cache


def _layer(cache: DynamicCache, layer: int) -> Any:
    """One cache layer, untyped: transformers' layer classes share no typed interface."""
    return cache.layers[layer]


def _tensor(cache: DynamicCache, layer: int, part: str) -> torch.Tensor:
    got = getattr(cache.layers[layer], part, None)
    if not isinstance(got, torch.Tensor) or got.dim() != 4:
        raise CacheMismatchError(f"layer {layer} keeps no {part} (got {type(got).__name__})")
    return got


def _state(cache: DynamicCache, layer: int, attr: str) -> torch.Tensor:
    states = getattr(cache.layers[layer], attr, None) or {}
    got = states.get(0)
    if len(states) != 1 or not isinstance(got, torch.Tensor):
        raise CacheMismatchError(f"layer {layer} keeps {len(states)} {attr}, expected one tensor")
    return got


def _same(what: str, got: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(got.shape) != shape or got.dtype != dtype:
        raise CacheMismatchError(f"{what}: the model keeps {tuple(got.shape)} {got.dtype}, the "
                                 f"layout describes {shape} {dtype}")
