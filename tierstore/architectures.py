"""Which cache each layer of a Hugging Face architecture keeps, and the shapes of its state.

Reads a config dict only (no transformers import). A layer keeps an attention cache (``full``
or ``swa``), a recurrent state, or both (Falcon-H1 runs attention and Mamba2 side by side in
every layer). Recurrent states come in four flavours, named by the mixer that keeps them:

- ``gdn`` (Gated DeltaNet: qwen3_next, qwen3_5): conv ``(2*Hk*Dk + Hv*Dv, K-1)``, ssm
  ``(Hv, Dk, Dv)``;
- ``mamba2`` (nemotron_h, granitemoehybrid, bamba, falcon_h1): conv ``(H*P + 2*G*N, K-1)``,
  ssm ``(H, P, N)``;
- ``mamba1`` (jamba): conv ``(E*hidden, K-1)``, ssm ``(E*hidden, N)``;
- ``conv`` (short convolution: lfm2, lfm2_moe): conv ``(hidden, L-1)``, no ssm.

Heads, groups and channels are per TP rank. Conv states keep ``kernel - 1`` columns, as
engines do (SGLang, vLLM): the oldest of the ``kernel`` columns transformers keeps is never
read again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tierstore.errors import UsageError

__all__ = ["LayerCache", "LayoutError", "layer_caches", "recurrent_fields"]

Attention = Literal["full", "swa"]
Recurrent = Literal["gdn", "mamba2", "mamba1", "conv"]


class LayoutError(UsageError):
    """A config (or request) the layout cannot interpret; the message names the key and value."""


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer caches: an attention kind, a recurrent flavour, both or neither."""

    attention: Attention | None = None
    recurrent: Recurrent | None = None


_NONE = LayerCache()
_FULL = LayerCache("full")
_SWA = LayerCache("swa")

_GDN_MODELS = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
_FAMILY: dict[str, Recurrent] = {
    **dict.fromkeys(_GDN_MODELS, "gdn"),
    **dict.fromkeys(("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1"), "mamba2"),
    "jamba": "mamba1",
    **dict.fromkeys(("lfm2", "lfm2_moe"), "conv"),
}
# Mamba2 field names (heads, head dim, groups, state, conv kernel), picked by model type: a
# config keeps unknown kwargs, so a key of the other spelling may ride along and must not win.
_NEMOTRON_MAMBA2 = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                    "conv_kernel")
_GRANITE_MAMBA2 = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                   "mamba_d_conv")  # Granite-4.0-H, Bamba, Falcon-H1
_MAMBA2_NAMES = {"nemotron_h": _NEMOTRON_MAMBA2,
                 **dict.fromkeys(("granitemoehybrid", "bamba", "falcon_h1"), _GRANITE_MAMBA2)}
# Hybrids whose recurrent layers keep a state none of the flavours above describes: refused by
# name rather than read with field names they happen to share with Qwen3-Next.
_UNSUPPORTED = {
    "bailing_hybrid", "glm5_next", "kimi_linear", "minimax", "olmo_hybrid", "qwen4_exp",
    "recurrent_gemma", "zamba", "zamba2", "inkling", "inkling2", "lfm3", "zaya",
}
# Per-layer names across spellings: transformers 5.x layer_types, Nemotron-H's and Granite's
# hub spellings (mamba / attention), Falcon-H1's "hybrid", LFM2's "conv".
_ATTENTION: dict[str, LayerCache] = {
    "full_attention": _FULL, "attention": _FULL, "sliding_attention": _SWA,
    "mlp": _NONE, "moe": _NONE, "dummy": _NONE,
}
_RECURRENT_NAMES = {"linear_attention", "mamba", "conv", "hybrid"}
# Nemotron-H pattern: M = Mamba2, * = attention, - = MLP, E = MoE (the last two hold no cache).
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def layer_caches(config: dict[str, Any]) -> list[LayerCache]:
    """Per-layer caches from ``layer_types``, ``layers_block_type``, Nemotron-H's pattern or
    the model type's own fields; LayoutError naming the key for anything else."""
    model_type = config.get("model_type")
    if model_type in _UNSUPPORTED:
        raise LayoutError(f"config key 'model_type' = {model_type!r}: its recurrent layers keep "
                          "a state the layout does not describe")
    for key in ("layer_types", "layers_block_type"):
        if key in config and config[key] is not None:
            layers = _mapped(config, key, config[key])
            break
    else:
        layers = _defaults(config, model_type)
    declared = config.get("num_hidden_layers")
    if declared is not None and declared != len(layers):
        raise LayoutError(f"config key 'num_hidden_layers' = {declared!r} disagrees with the "
                          f"{len(layers)} layers its layer types describe")
    return layers


def _mapped(config: dict[str, Any], key: str, values: object) -> list[LayerCache]:
    """Map a per-layer list (or pattern string) of names; LayoutError on a stray value."""
    if not isinstance(values, (list, str)) or not values:
        raise LayoutError(f"config key {key!r} = {values!r} must be a non-empty list or string")
    names = sorted([*_ATTENTION, *_RECURRENT_NAMES])
    out = []
    for i, value in enumerate(values):
        if key == "hybrid_override_pattern":
            if value not in _PATTERN:
                raise LayoutError(f"config key {key!r}[{i}] = {value!r} is not one of "
                                  f"{sorted(_PATTERN)}")
            value = _PATTERN[value]
        if not isinstance(value, str) or value not in names:
            raise LayoutError(f"config key {key!r}[{i}] = {value!r} is not one of {names}")
        out.append(_ATTENTION[value] if value in _ATTENTION else _recurrent(config, value))
    return out


def _recurrent(config: dict[str, Any], name: str) -> LayerCache:
    """The cache of a layer named ``name`` in ``_RECURRENT_NAMES``, by the model's family."""
    family = _FAMILY.get(str(config.get("model_type")))
    if name == "conv":
        return LayerCache(recurrent="conv")
    if name == "hybrid":
        return LayerCache("full", family or "mamba2")
    if name == "mamba":
        return LayerCache(recurrent=family if family in ("mamba1", "mamba2") else "mamba2")
    return LayerCache(recurrent=family or "gdn")  # linear_attention: Qwen3-Next by default


def _defaults(config: dict[str, Any], model_type: object) -> list[LayerCache]:
    """Layers of configs without a per-layer list, as each model's transformers code lays
    them out (the fields its hub ``config.json`` files carry)."""
    if model_type == "nemotron_h":
        if "hybrid_override_pattern" not in config:
            raise LayoutError("config keys 'layers_block_type' and 'hybrid_override_pattern' are "
                              "both missing (nemotron_h layers)")
        return _mapped(config, "hybrid_override_pattern", config["hybrid_override_pattern"])
    if model_type in ("qwen3_next", *_GDN_MODELS):
        n = positive(config, "num_hidden_layers", f"{model_type} layer types")
        every = positive(config, "full_attention_interval", f"{model_type} layer types")
        return [_FULL if (i + 1) % every == 0 else LayerCache(recurrent="gdn") for i in range(n)]
    if model_type == "gpt_oss":  # the transformers default: sliding first
        n = positive(config, "num_hidden_layers", "gpt_oss layer types")
        return [_SWA if i % 2 == 0 else _FULL for i in range(n)]
    if model_type == "falcon_h1":  # every layer runs attention and Mamba2 in parallel
        n = positive(config, "num_hidden_layers", "falcon_h1 layer types")
        return [LayerCache("full", "mamba2")] * n
    if model_type == "granitemoehybrid":  # the transformers default: all Mamba2
        n = positive(config, "num_hidden_layers", "granitemoehybrid layer types")
        return [LayerCache(recurrent="mamba2")] * n
    if model_type in ("bamba", "lfm2", "lfm2_moe"):
        key = "attn_layer_indices" if model_type == "bamba" else "full_attn_idxs"
        n = positive(config, "num_hidden_layers", f"{model_type} layer types")
        attention = _indices(config, key, n)
        other = LayerCache(recurrent=_FAMILY[model_type])
        return [_FULL if i in attention else other for i in range(n)]
    if model_type == "jamba":
        n = positive(config, "num_hidden_layers", "jamba layer types")
        period = positive(config, "attn_layer_period", "jamba layer types")
        offset = config.get("attn_layer_offset")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
            raise LayoutError(f"config key 'attn_layer_offset' = {offset!r} must be an integer "
                              f"in [0, attn_layer_period = {period})")
        return [_FULL if i % period == offset else LayerCache(recurrent="mamba1")
                for i in range(n)]
    raise LayoutError(f"config key 'model_type' = {model_type!r} is not supported and the "
                      "config has no 'layer_types'")


def _indices(config: dict[str, Any], key: str, n: int) -> set[int]:
    values = config.get(key)
    if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n for v in values):
        raise LayoutError(f"config key {key!r} = {values!r} must be a list of layer indices "
                          f"in [0, {n})")
    return set(values)


def recurrent_fields(config: dict[str, Any], flavour: Recurrent, tp_size: int
                     ) -> tuple[tuple[int, int], tuple[int, ...] | None]:
    """(conv shape, ssm shape or None) of one recurrent layer on one TP rank."""
    if flavour == "gdn":
        why, kernel_key = "linear-attention state", "linear_conv_kernel_dim"
        k_heads = divide(config, "linear_num_key_heads", tp_size, why)
        v_heads = divide(config, "linear_num_value_heads", tp_size, why)
        k_dim = positive(config, "linear_key_head_dim", why)
        v_dim = positive(config, "linear_value_head_dim", why)
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        ssm: tuple[int, ...] | None = (v_heads, k_dim, v_dim)
    elif flavour == "mamba2":
        why = "Mamba2 state"
        names = _MAMBA2_NAMES.get(str(config.get("model_type")))
        if names is None:  # no model type that fixes the spelling: the one its keys use
            names = _GRANITE_MAMBA2 if "mamba_n_heads" in config else _NEMOTRON_MAMBA2
        heads_key, head_dim_key, groups_key, state_key, kernel_key = names
        heads = divide(config, heads_key, tp_size, why)
        groups = divide(config, groups_key, tp_size, why)
        head_dim = _mamba_head_dim(config, head_dim_key, heads_key)
        d_state = positive(config, state_key, why)
        conv_dim = heads * head_dim + 2 * groups * d_state
        ssm = (heads, head_dim, d_state)
    elif flavour == "mamba1":
        why, kernel_key = "Mamba state", "mamba_d_conv"
        inner = positive(config, "mamba_expand", why) * positive(config, "hidden_size", why)
        conv_dim = _divided(inner, tp_size, "config keys 'mamba_expand' * 'hidden_size'")
        ssm = (conv_dim, positive(config, "mamba_d_state", why))
    else:
        kernel_key = "conv_L_cache"
        conv_dim = divide(config, "hidden_size", tp_size, "short-conv state")
        ssm = None
    kernel = positive(config, kernel_key, f"{flavour} conv state")
    if kernel < 2:
        raise LayoutError(f"config key {kernel_key!r} = {kernel} must be at least 2 to carry "
                          "state")
    return (conv_dim, kernel - 1), ssm


def _mamba_head_dim(config: dict[str, Any], key: str, heads_key: str) -> int:
    """``mamba_d_head``, resolving transformers' ``"auto"`` (inner size / heads)."""
    if config.get(key) != "auto":
        return positive(config, key, "Mamba2 state")
    heads = positive(config, heads_key, "Mamba2 state")
    inner = config.get("mamba_d_ssm") or (positive(config, "mamba_expand", "Mamba2 state")
                                          * positive(config, "hidden_size", "Mamba2 state"))
    if not isinstance(inner, int) or inner % heads:
        raise LayoutError(f"config key {key!r} = 'auto' but the Mamba inner size {inner!r} is "
                          f"not divisible by {heads_key!r} = {heads}")
    return inner // heads


def positive(config: dict[str, Any], key: str, why: str) -> int:
    """The positive int at ``key``; LayoutError naming the key when missing or invalid."""
    if key not in config:
        raise LayoutError(f"config key {key!r} is missing (needed for {why})")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"config key {key!r} = {value!r} must be a positive integer")
    return value


def divide(config: dict[str, Any], key: str, tp_size: int, why: str) -> int:
    """``config[key]`` split over ``tp_size`` ranks; LayoutError when it does not divide."""
    return _divided(positive(config, key, why), tp_size, f"config key {key!r}")


def _divided(total: int, tp_size: int, label: str) -> int:
    if total % tp_size:
        raise LayoutError(f"{label} = {total} is not divisible by tp_size {tp_size}")
    return total // tp_size
