"""The device dispatch of the layers' row-wise ops (modeling/ops.py).

Without CUDA the Triton set runs in Triton's CPU interpreter, so its routing (skinny GEMM or cuBLAS fallback,
K and V written in place) is checked here against the torch set through a whole decoder layer; with CUDA the same
check runs the compiled kernels.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling import layers
from modeling.config import ModelConfig, RopeConfig
from modeling.decoder import DecoderLayer
from modeling.ops import TorchRowOps, TritonRowOps, row_ops
from modeling.rope import RotaryEmbedding
from tests.engine_helpers import CausalAttention


def test_modeling_loads_no_triton_until_a_cuda_tensor_asks() -> None:
    code = ("import sys, torch, modeling.dflash, modeling.tensor_parallel\n"
            "from modeling.ops import TorchRowOps, row_ops\n"
            "assert type(row_ops(torch.zeros(1))) is TorchRowOps\n"
            "assert not [m for m in sys.modules if m.startswith(('triton', 'ddtree_kernels'))], 'Triton loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_cpu_tensors_get_the_torch_ops() -> None:
    assert type(row_ops(torch.zeros(1))) is TorchRowOps


class ScratchAttention(CausalAttention):
    """Causal attention whose K/V buffers are preallocated, as the engine's tree scratch is."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def kv_buffers(self, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:num_tokens], self.v[:num_tokens]


@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3, Llama
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tokens", [5, 40])  # the skinny GEMM's few rows, and past MAX_ROWS (cuBLAS)
def test_triton_ops_match_torch_ops_through_a_layer(monkeypatch: pytest.MonkeyPatch, qk_norm: bool, fused: bool,
                                                    tokens: int) -> None:
    config = ModelConfig("Qwen3ForCausalLM", vocab_size=8, hidden_size=64, intermediate_size=128, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope=RopeConfig(),
                         max_position_embeddings=128, qk_norm=qk_norm, mlp_bias=True)
    torch.manual_seed(0)
    layer = DecoderLayer(config, 0)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, mean=1.0 if parameter.dim() == 1 else 0.0, std=0.1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = layer.half().to(device)
    if fused:
        layer.fuse_projections()
    x, pending = (torch.randn(tokens, 64, dtype=torch.float16, device=device) for _ in range(2))
    cos, sin = (t.to(device) for t in RotaryEmbedding(config.rope, 32)(torch.arange(tokens), torch.float16))
    scratch = torch.zeros(2, tokens, 2, 32, dtype=torch.float16, device=device)

    def run(attend: ScratchAttention) -> tuple[torch.Tensor, ...]:  # the layer, and a norm with no residual add
        return *layer(0, x, pending, cos, sin, attend), layer.input_layernorm(x)

    with torch.no_grad():
        monkeypatch.setattr(layers, "row_ops", lambda _: TorchRowOps())
        expected = run(ScratchAttention(*scratch.clone()))
        monkeypatch.setattr(layers, "row_ops", lambda _: TritonRowOps())
        got = run(ScratchAttention(*scratch))
    for actual, want in zip(got, expected):
        torch.testing.assert_close(actual.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert scratch.any() == fused  # the fused Q/K/V epilogue writes K and V where attention reads them
