"""A tiny hybrid model that prefills and decodes through a :class:`TierStore`.

Seeded random weights; full-attention, sliding-window and gated-linear-recurrence layers. Its KV
pages, SWA pages and recurrent state live in the store's arena and are read and written through
per-layer views, so a prefix hit really reuses cached bytes. Comparing its logits with and
without a hit is the end-to-end check that layouts, views and id mappings are right.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierstore.layout import ModelLayout, layout_from_config
from tierstore.results import MatchResult
from tierstore.store import TierStore

CONFIG = {
    "name": "tiny-hybrid",
    "layer_types": ["full_attention", "linear_attention", "sliding_attention",
                    "full_attention", "linear_attention", "full_attention"],
    "hidden_size": 32, "vocab_size": 97, "torch_dtype": "float32",
    "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 8,
    "linear_num_key_heads": 2, "linear_key_head_dim": 8,
    "linear_num_value_heads": 2, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
}


def tiny_layout(page_size: int = 4, config: dict | None = None) -> ModelLayout:
    """The reference model's layout (generic ``layer_types`` config form)."""
    return layout_from_config(dict(config or CONFIG), page_size=page_size)


@dataclass
class Served:
    """One request's outcome: logits for the last prompt token and each generated token."""

    logits: torch.Tensor  # [1 + generated, vocab]
    tokens: list[int]  # generated token ids (greedy)
    cached_tokens: int  # prompt tokens reused from the cache


class ReferenceModel:
    """Greedy generation for the tiny hybrid model, one token at a time, through ``store``."""

    def __init__(self, store: TierStore, seed: int = 0, config: dict | None = None) -> None:
        self.store = store
        self.cfg = dict(config or CONFIG)
        self.layout = store.layout
        g = torch.Generator().manual_seed(seed)
        d, self.vocab = self.cfg["hidden_size"], self.cfg["vocab_size"]
        self.heads, self.head_dim = self.cfg["num_key_value_heads"], self.cfg["head_dim"]
        self.window = self.cfg["sliding_window"]
        hk, dk = self.cfg["linear_num_key_heads"], self.cfg["linear_key_head_dim"]
        hv, dv = self.cfg["linear_num_value_heads"], self.cfg["linear_value_head_dim"]
        self.hk, self.dk, self.hv, self.dv = hk, dk, hv, dv
        self.kernel = self.cfg["linear_conv_kernel_dim"]
        conv_dim = 2 * hk * dk + hv * dv

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

        self.embed = torch.randn(self.vocab, d, generator=g)
        self.lm_head = w(self.vocab, d)
        attn = self.heads * self.head_dim
        self.weights: list[dict[str, torch.Tensor]] = []
        for kind in self.cfg["layer_types"]:
            if kind == "linear_attention":
                self.weights.append({"in": w(conv_dim, d), "conv": w(conv_dim, self.kernel),
                                     "gate": w(hv, d), "out": w(d, hv * dv)})
            else:
                self.weights.append({"q": w(attn, d), "k": w(attn, d), "v": w(attn, d),
                                     "o": w(d, attn)})
        # The weights live where the arena does, so a CUDA store runs the model on the GPU.
        device = store.arena.device
        self.embed, self.lm_head = self.embed.to(device), self.lm_head.to(device)
        self.weights = [{k: t.to(device) for k, t in wts.items()} for wts in self.weights]
        self.views = self._views()

    def _views(self) -> dict[str, torch.Tensor]:
        arena, views = self.store.arena, {}
        for kind, env in self.layout.envelopes().items():
            for f in env.fields:
                views[f.name] = arena.layer_view(kind, f.dtype, f.shape, f.strides, f.offset)
        return views

    # ------------------------------------------------------------------ serving
    def generate(self, prompt: list[int], max_new_tokens: int = 0, namespace: str = "default",
                 *, use_cache: bool = True) -> Served:
        """Serve one request: match, allocate, prefill the uncached suffix (capturing a state
        checkpoint at the last full page), decode greedily, insert the prompt, release."""
        page = self.layout.page_size
        match = self.store.match(prompt[:-1], namespace) if use_cache else None
        start = match.tokens if match is not None else 0
        total = len(prompt) + max_new_tokens
        first_new, n_pages = start // page, -(-total // page)
        # The checkpoint goes at the last page boundary before the final prompt token: a repeat
        # of this prompt must still compute one token to get logits, so it can use it.
        boundary = ((len(prompt) - 1) // page) * page
        alloc = self.store.allocate({"kv": n_pages - first_new, "swa": n_pages - first_new,
                                     "state": 2})
        if alloc is None:
            raise RuntimeError("the store cannot fit this request even after evicting")
        kv = torch.cat([match.kv if match else torch.empty(0, dtype=torch.long), alloc["kv"]])
        swa = torch.cat([match.swa if match else torch.empty(0, dtype=torch.long),
                         alloc["swa"]])
        work, checkpoint = (int(i) for i in alloc["state"])
        self._load_state(work, match)
        logits, generated, token, pos = [], [], prompt[start] if start < len(prompt) else 0, start
        seq = list(prompt)
        while pos < total:
            token = seq[pos]
            out = self._step(token, pos, kv, swa, work)
            if pos + 1 == boundary and boundary > start:
                self._copy_state(work, checkpoint)
            if pos >= len(prompt) - 1:
                logits.append(out)
                if len(seq) < total:
                    nxt = int(out.argmax())
                    generated.append(nxt)
                    seq.append(nxt)
            pos += 1
        keep_pages = boundary // page
        insert_kv = kv[:keep_pages]
        insert_swa = swa[first_new:keep_pages]
        state = checkpoint if boundary > start else None
        self.store.insert(prompt[:boundary], namespace, kv=insert_kv, swa=insert_swa,
                          state=state)
        self.store.free("kv", alloc["kv"][max(0, keep_pages - first_new):])
        self.store.free("swa", alloc["swa"][max(0, keep_pages - first_new):])
        self.store.free("state", [work] if state is not None else [work, checkpoint])
        if match is not None and match.lease is not None:
            self.store.release(match.lease)
        return Served(torch.stack(logits), generated, start)

    # ------------------------------------------------------------------ the model
    def _step(self, token: int, pos: int, kv: torch.Tensor, swa: torch.Tensor, work: int
              ) -> torch.Tensor:
        x = self.embed[token]
        for layer, (kind, wts) in enumerate(zip(self.cfg["layer_types"], self.weights,
                                                strict=True)):
            h = F.rms_norm(x, (x.numel(),))
            if kind == "linear_attention":
                x = x + self._recurrent(layer, wts, h, work)
            else:
                x = x + self._attention(layer, kind, wts, h, pos, kv if kind == "full_attention"
                                        else swa)
        return self.lm_head @ F.rms_norm(x, (x.numel(),))

    def _attention(self, layer: int, kind: str, wts: dict[str, torch.Tensor], h: torch.Tensor,
                   pos: int, pages: torch.Tensor) -> torch.Tensor:
        page, pool = self.layout.page_size, "kv" if kind == "full_attention" else "swa"
        k_view, v_view = self.views[f"k.{layer}"], self.views[f"v.{layer}"]
        q = (wts["q"] @ h).view(self.heads, self.head_dim)
        slot = int(self.store.arena.resolve(pool, pages[pos // page : pos // page + 1])[0])
        k_view[slot, pos % page] = (wts["k"] @ h).view(self.heads, self.head_dim)
        v_view[slot, pos % page] = (wts["v"] @ h).view(self.heads, self.head_dim)
        first = 0 if kind == "full_attention" else max(0, pos - self.window + 1)
        p0, p1 = first // page, pos // page + 1
        slots = self.store.arena.resolve(pool, pages[p0:p1])
        keys = k_view[slots].reshape(-1, self.heads, self.head_dim)
        values = v_view[slots].reshape(-1, self.heads, self.head_dim)
        lo, hi = first - p0 * page, pos - p0 * page + 1
        keys, values = keys[lo:hi], values[lo:hi]
        scores = torch.einsum("hd,thd->ht", q, keys) / math.sqrt(self.head_dim)
        out = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
        return wts["o"] @ out.reshape(-1)

    def _recurrent(self, layer: int, wts: dict[str, torch.Tensor], h: torch.Tensor, work: int
                   ) -> torch.Tensor:
        """Gated linear recurrence: causal depthwise conv, then S = g*S + k v^T, out = q S."""
        slot = int(self.store.arena.resolve("state", [work])[0])
        conv_state = self.views[f"conv.{layer}"][slot]  # [conv_dim, kernel - 1]
        ssm = self.views[f"ssm.{layer}"][slot]  # [hv, dk, dv]
        x = wts["in"] @ h
        window = torch.cat([conv_state, x.unsqueeze(1)], dim=1)  # [conv_dim, kernel]
        mixed = F.silu((window * wts["conv"]).sum(1))
        conv_state.copy_(window[:, 1:])
        qd, kd = self.hk * self.dk, self.hk * self.dk
        q = mixed[:qd].view(self.hk, self.dk)
        k = F.normalize(mixed[qd : qd + kd].view(self.hk, self.dk), dim=-1)
        v = mixed[qd + kd :].view(self.hv, self.dv)
        gate = torch.sigmoid(wts["gate"] @ h).view(self.hv, 1, 1)
        new = gate * ssm + torch.einsum("hk,hv->hkv", k, v)
        ssm.copy_(new)
        out = torch.einsum("hk,hkv->hv", q, new)
        return wts["out"] @ out.reshape(-1)

    # ------------------------------------------------------------------ state
    def _load_state(self, work: int, match: MatchResult | None) -> None:
        arena = self.store.arena
        if match is not None and match.state is not None:
            arena.write("state", [work], arena.read("state", [match.state]))
        else:
            unit = arena.spec("state").unit_bytes
            arena.write("state", [work], torch.zeros(1, unit, dtype=torch.uint8))

    def _copy_state(self, src: int, dst: int) -> None:
        arena = self.store.arena
        arena.write("state", [dst], arena.read("state", [src]))
