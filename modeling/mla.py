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
(what transformers' DeepSeek-V3 caches as k_rot). With `rope_interleave` false the columns are already halves;
`fuse_projections` reorders the projections' RoPE rows once, so served models get halves without the copies.
"""

from __future__ import annotations

import torch
from torch import nn

from modeling.config import ModelConfig
from modeling.layers import FusedLinear, LayerAttention, Linear, RMSNorm
from modeling.ops import row_ops

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
        self.q_kv_a: FusedLinear | None = None  # the query's first projection and kv_a as one GEMM (serving)
        self.rope_halves = not mla.rope_interleave  # whether the projections emit RoPE columns as halves

    def fuse_projections(self) -> None:
        """For CUDA serving: the projections that read the layer input (q_a_proj or q_proj, and
        kv_a_proj_with_mqa) as one GEMM, and their RoPE rows reordered so the columns come out de-interleaved
        (evens, then odds): the values the forward's reordering copies would make, without the copies. Idempotent:
        a second call must not move the weights, since captured CUDA graphs read them."""
        if self.q_kv_a is not None:
            return
        first = self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj
        rope_query = self.q_proj if self.mla.q_lora_rank is None else self.q_b_proj
        if not self.rope_halves:
            _deinterleave_rope_rows(rope_query, self.mla.qk_head_dim, self.mla.qk_rope_head_dim)
            _deinterleave_rope_rows(self.kv_a_proj_with_mqa, self.mla.latent_dim, self.mla.qk_rope_head_dim)
            self.rope_halves = True
        if (first.bias is None) == (self.kv_a_proj_with_mqa.bias is None):
            self.q_kv_a = FusedLinear(first, self.kv_a_proj_with_mqa)

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: LayerAttention) -> torch.Tensor:
        """x: [N, hidden] normed; cos, sin: [N, qk_rope_head_dim] -> [N, hidden]."""
        mla, n, heads, rank = self.mla, x.shape[0], self.num_heads, self.mla.kv_lora_rank
        ops = row_ops(x)
        w_uk, w_uv = self.absorbed_weights()
        query, kv = self.project(x)
        q_nope, q_pe = query.view(n, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim],
                                                                   dim=-1)
        entry = ops.latent_entry(self.as_halves(kv), self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos, sin,
                                 attend.latent_rows(layer, n))
        # NOTE: q [N, H, latent_dim] is laid out head by head, so the absorption's batched GEMM and the RoPE write
        # their columns in place (no concatenation)
        q = x.new_empty(heads, n, mla.latent_dim).transpose(0, 1)
        q_rope = ops.norm_rope(self.as_halves(q_pe), None, 0.0, cos, sin, out=q[..., rank:])
        values = attend.latent_expanded(layer, q_nope, q_rope, entry, w_uk, w_uv)  # NOTE: a long prefill chunk
        if values is None:
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=q.transpose(0, 1)[..., :rank])
            latents = attend.latent(layer, q, entry)  # [N, H, kv_lora_rank]
            values = x.new_empty(n, heads, mla.v_head_dim)  # NOTE: [N, H * v] rows for o_proj, written head by head
            torch.bmm(latents.transpose(0, 1), w_uv.transpose(1, 2), out=values.transpose(0, 1))
        return self.o_proj(values.reshape(n, -1))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, hidden] -> the query [N, H * qk_head_dim] (through the low-rank pair when the model has one) and the
        kv_a projection [N, latent_dim]."""
        if self.q_kv_a is not None:
            query, kv = self.q_kv_a(x)
        else:
            query = (self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj)(x)
            kv = self.kv_a_proj_with_mqa(x)
        if self.mla.q_lora_rank is not None:
            query = self.q_b_proj(self.q_a_layernorm(query))
        return query, kv

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_UK [H, qk_nope_head_dim, kv_lora_rank] and W_UV [H, v_head_dim,
        kv_lora_rank] (views: loading and tensor-parallel slicing see only kv_b_proj)."""
        mla = self.mla
        weight = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = weight.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        return w_uk, w_uv

    def as_halves(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] with its last qk_rope_head_dim columns in the cache's RoPE layout (module docstring)."""
        if self.rope_halves:
            return x
        rope = self.mla.qk_rope_head_dim
        return torch.cat([x[..., :-rope], x[..., -rope::2], x[..., 1 - rope::2]], dim=-1)


def _deinterleave_rope_rows(linear: Linear, row_group: int, rope_dim: int) -> None:
    """In place: in each group of `row_group` output rows, the last `rope_dim` (a head's RoPE part) reordered
    evens then odds, so the projection emits them as `MLAttention.as_halves` reorders them."""
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)]).to(linear.weight.device)
    for tensor in (linear.weight, linear.bias):
        if tensor is not None:
            grouped = tensor.data.view(-1, row_group, *tensor.shape[1:])
            grouped[:, -rope_dim:] = grouped[:, -rope_dim:][:, order]
