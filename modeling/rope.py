"""Rotary position embeddings with the scaling variants of Hugging Face checkpoints."""

from __future__ import annotations

import math

import torch

from modeling.config import RopeConfig


def _yarn(base_freqs: torch.Tensor, dim: int, theta: float, params: dict) -> tuple[torch.Tensor, float]:
    factor = params["factor"]
    original_max = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 keeps the original frequency (high-frequency dims)
    inv_freq = base_freqs / factor * (1 - extrapolation) + base_freqs * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(base_freqs: torch.Tensor, params: dict) -> torch.Tensor:
    factor, original_max = params["factor"], params["original_max_position_embeddings"]
    low_wavelen = original_max / params.get("low_freq_factor", 1.0)
    high_wavelen = original_max / params.get("high_freq_factor", 4.0)
    wavelen = 2 * math.pi / base_freqs
    scaled = torch.where(wavelen > low_wavelen, base_freqs / factor, base_freqs)
    smooth = (original_max / wavelen - params.get("low_freq_factor", 1.0)) / (
        params.get("high_freq_factor", 4.0) - params.get("low_freq_factor", 1.0))
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """`[head_dim // 2]` fp32 inverse frequencies and the cos/sin scale (attention factor)."""
    base = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.rope_type == "default":
        return base, 1.0
    if rope.rope_type == "linear":
        return base / rope.params["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3(base, rope.params), 1.0
    if rope.rope_type == "yarn":
        return _yarn(base, head_dim, rope.theta, rope.params)
    raise ValueError(f"rope_type {rope.rope_type!r} is not supported (default, linear, llama3, yarn)")


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for arbitrary (packed, non-contiguous) positions."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        inv_freq, self.scale = inverse_frequencies(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [N] -> cos, sin: [N, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; cos, sin: [N, D] (the rotate-half convention of HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
