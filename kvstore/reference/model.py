"""A Llama-style decoder over a paged KV cache (the reference engine's model).

``forward(input_ids, positions, kv_caches, attn_metadata)`` computes the hidden states of a
flattened batch: prefill sequences first, then decode tokens, as vLLM V0 lays them out. Each
layer writes the new tokens' K/V at ``attn_metadata.slot_mapping`` and attends, per sequence,
over the ``seq_lens[i]`` tokens found through ``block_tables[i]`` (so KV loaded by a connector
is read exactly like KV the model computed). A model may hold a layer range
``[start_layer, end_layer)`` (a pipeline stage): the first stage embeds, the last applies the
final norm; other stages take and return ``{"hidden_states", "residual"}``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvstore.reference.config import EngineConfig
from kvstore.reference.kvcache import EngineKV
from kvstore.reference.weights import init_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` rotated by position (``cos``/``sin`` ``[T, 1, D/2]``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaModel:
    """The reference model (weights held as plain tensors; no autograd)."""

    def __init__(self, config: EngineConfig, start_layer: int = 0, end_layer: int | None = None) -> None:
        c = self.config = config
        self.start_layer = start_layer
        self.end_layer = c.num_layers if end_layer is None else end_layer
        self.is_first = start_layer == 0
        self.is_last = self.end_layer == c.num_layers
        self.dtype = getattr(torch, c.dtype)
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = init_weight(c, "embed", (c.vocab_size, c.hidden_size), std=1.0) if self.is_first else None
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(self.start_layer, self.end_layer):
            def w(n: str, shape: tuple[int, ...], i: int = i) -> torch.Tensor:
                return init_weight(c, f"layers.{i}.{n}", shape)

            self.layers.append({
                "qkv": torch.cat([w("q", (q, c.hidden_size)), w("k", (kv, c.hidden_size)), w("v", (kv, c.hidden_size))]),
                "o": w("o", (c.hidden_size, q)),
                "gate_up": torch.cat([w("gate", (c.intermediate_size, c.hidden_size)), w("up", (c.intermediate_size, c.hidden_size))]),
                "down": w("down", (c.hidden_size, c.intermediate_size)),
                "ln1": torch.ones(c.hidden_size, dtype=self.dtype, device=c.device),
                "ln2": torch.ones(c.hidden_size, dtype=self.dtype, device=c.device),
            })
        if self.is_last:
            self.norm = torch.ones(c.hidden_size, dtype=self.dtype, device=c.device)
            self.lm_head = init_weight(c, "lm_head", (c.vocab_size, c.hidden_size))
        half = c.head_dim // 2
        self.inv_freq = (1.0 / (c.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))).to(c.device)
        self.kv = EngineKV(c.kv_layout, c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, self.dtype, c.device)

    @property
    def model(self) -> LlamaModel:
        """vLLM V0 connectors read ``model_executable.model.start_layer``; this object is both."""
        return self

    def allocate_kv_caches(self) -> list[torch.Tensor]:
        """One paged cache per layer of this stage."""
        return [self.kv.allocate() for _ in self.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, intermediate: dict[str, torch.Tensor] | None = None,
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        c = self.config
        residual: torch.Tensor | None
        if self.is_first:
            assert self.embed is not None  # the first stage holds the embedding
            hidden = self.embed[input_ids]
            residual = None
        else:
            assert intermediate is not None, "a later pipeline stage needs the previous stage's intermediate"
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq
        cos, sin = freqs.cos()[:, None, :].to(self.dtype), freqs.sin()[:, None, :].to(self.dtype)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for layer, cache in zip(self.layers, kv_caches):
            if residual is None:
                residual, x = hidden, rms_norm(hidden, layer["ln1"], c.rms_eps)
            else:
                residual = hidden + residual
                x = rms_norm(residual, layer["ln1"], c.rms_eps)
            qkv = x @ layer["qkv"].T
            q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(q.reshape(-1, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(k.reshape(-1, c.num_kv_heads, c.head_dim), cos, sin)
            self.kv.write(cache, attn_metadata.slot_mapping, k, v.reshape(-1, c.num_kv_heads, c.head_dim))
            attn = self._attention(q, cache, attn_metadata)
            hidden = attn.reshape(-1, q_size) @ layer["o"].T
            residual = hidden + residual
            x = rms_norm(residual, layer["ln2"], c.rms_eps)
            gate, up = (x @ layer["gate_up"].T).chunk(2, dim=-1)
            hidden = (F.silu(gate) * up) @ layer["down"].T
        assert residual is not None  # set by the previous stage or by this stage's first layer
        if not self.is_last:
            return {"hidden_states": hidden, "residual": residual}
        return rms_norm(hidden + residual, self.norm, c.rms_eps)

    def _attention(self, q: torch.Tensor, cache: torch.Tensor, md: Any) -> torch.Tensor:
        out = torch.empty_like(q)
        qsl = md.query_start_loc.tolist()
        for i, seq_len in enumerate(md.seq_lens):
            a, b = qsl[i], qsl[i + 1]
            k, v = self.kv.read(cache, md.block_tables[i], seq_len)
            qi = q[a:b].transpose(0, 1)[None]  # [1, Hq, Tq, D]
            ki, vi = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            tq, ctx = b - a, seq_len - (b - a)
            if ctx == 0:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            elif tq == 1:
                o = F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)
            else:  # a suffix after a cached prefix: query j sees keys up to ctx + j
                mask = torch.arange(seq_len, device=q.device)[None, :] <= (ctx + torch.arange(tq, device=q.device))[:, None]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
            out[a:b] = o[0].transpose(0, 1)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head.T).float()

    __call__ = forward
