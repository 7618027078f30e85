"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash), computed in absorbed form (a long prefill
chunk may take the expanded form instead: `LayerAttention.latent_expanded`).

Per token the cache keeps one entry of latent_dim = kv_lora_rank + qk_rope_head_dim values: the normalised KV
latent, then the rotated RoPE key shared by all heads. Instead of expanding every cached latent into per-head
keys and values (kv_b_proj), the key half of kv_b_proj (W_UK) is folded into the query and the value half (W_UV)
into the output, so attention runs directly over the entries:

    q . k = q_nope . (W_UK c) + q_pe . k_pe = (W_UK^T q_nope) . c + q_pe . k_pe = [W_UK^T q_nope, q_pe] . entry
    out   = sum_s p_s W_UV c_s = W_UV (sum_s p_s c_s)

RoPE layout: the checkpoints rotate adjacent column pairs (x0, x1), (x2, x3), ... (DeepSeek-V2's complex
numbers, V3 / GLM's `rope_interleave`). Both q_pe and k_pe are de-interleaved (even columns, then odd ones) and
rotated rotate-half style, so a cache entry's last qk_rope_head_dim values are [rotated evens, rotated odds]
(what transformers' DeepSeek-V3 caches as k_rot). With `rope_interleave` false the columns are already halves.
"""

from __future__ import annotations

import torch
from torch import nn

from modeling.config import ModelConfig
from modeling.layers import LayerAttention, Linear, RMSNorm, norm_rope

# NOTE: the q and kv low-rank norms use RMSNorm's default eps in every checkpoint family, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Parameter names and biases as the checkpoints have them (`self_attn.q_proj` or `q_a_proj` /
    `q_a_layernorm` / `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        mla, hidden, bias = config.mla, config.hidden_size, config.attention_bias
        self.num_heads, self.mla = config.num_heads, mla
        q_out = self.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                bias=False)
        self.o_proj = Linear(self.num_heads * mla.v_head_dim, hidden, bias=bias)

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: LayerAttention) -> torch.Tensor:
        """x: [N, hidden] normed; cos, sin: [N, qk_rope_head_dim] -> [N, hidden]."""
        mla, n = self.mla, x.shape[0]
        w_uk, w_uv = self.absorbed_weights()
        q_nope, q_pe = self.query(x).view(n, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        q_pe = self.rotate(q_pe, cos, sin)
        entry = torch.cat([self.kv_a_layernorm(latent), self.rotate(k_pe[:, None], cos, sin)[:, 0]], dim=-1)
        values = attend.latent_expanded(layer, q_nope, q_pe, entry, w_uk, w_uv)  # NOTE: a long prefill chunk
        if values is None:
            q = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_pe], dim=-1)
            values = torch.einsum("nhr,hvr->nhv", attend.latent(layer, q, entry), w_uv)  # latents [N, H, r] first
        return self.o_proj(values.reshape(n, -1))

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, H * qk_head_dim], through the low-rank pair when the model has one."""
        if self.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_UK [H, qk_nope_head_dim, kv_lora_rank] and W_UV [H, v_head_dim,
        kv_lora_rank] (views: loading and tensor-parallel slicing see only kv_b_proj)."""
        mla = self.mla
        weight = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = weight.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        return w_uk, w_uv

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of x [N, H, qk_rope_head_dim] in the cache's layout (module docstring)."""
        if self.mla.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return norm_rope(x, None, cos, sin)
