"""The fused MoE kernel against the torch MoE (`MoE.run_experts`, itself checked against transformers in
tests/test_moe.py): its expert blocks, its output for every token count a step can have, a tensor-parallel rank's
subset of experts, and the stacked weights it reads.

Without CUDA the kernels run in Triton's CPU interpreter (fp16/fp32, small shapes); the `gpu` tests run bf16 at
the GLM-4.7-Flash and DeepSeek-V2-Lite expert shapes and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import transformers
import triton

from ddtree_kernels.fused_moe import MoELaunch, expert_blocks, fused_moe
from modeling.config import ModelConfig
from modeling.moe import MoE

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on CPU machines")
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


def moe_layer(hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0) -> MoE:
    """A DeepSeek-V3-routed MoE layer with random weights, on DEVICE."""
    hf_config = transformers.DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], hidden_size=hidden,
                                              moe_intermediate_size=inter, n_routed_experts=experts,
                                              num_experts_per_tok=top_k, n_group=1, topk_group=1,
                                              n_shared_experts=1)
    config = ModelConfig.from_hf(hf_config.to_dict())
    torch.manual_seed(seed)
    layer = MoE(config).requires_grad_(False)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=hidden**-0.5)
    layer.gate.e_score_correction_bias.normal_(std=0.1)
    layer.to(DEVICE)
    for module in (*layer.experts, layer.shared_experts):
        module.to(dtype)
    return layer


def reference_experts(layer: MoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The torch grouped loop on whatever device x is (the fused path is off until `fuse_projections`)."""
    stacked, layer.stacked = layer.stacked, None
    try:
        return layer.run_experts(x, ids, weights)
    finally:
        layer.stacked = stacked


def check_fused(layer: MoE, num_tokens: int, dtype: torch.dtype, launch: MoELaunch | None = None) -> None:
    x = torch.randn(num_tokens, layer.gate.weight.shape[1], device=DEVICE).to(dtype)
    ids, weights = layer.gate(x)
    want = reference_experts(layer, x, ids, weights)
    layer.fuse_projections()
    got = fused_moe(x, ids, weights, layer.stacked.w13, layer.stacked.w2, layer.stacked.first_expert, launch)
    assert got.dtype == torch.float32 and got.shape == want.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def reference_blocks(ids: torch.Tensor, first_expert: int, num_experts: int, block_m: int) -> list[list[int]]:
    """The layout in torch ops: a stable argsort by local expert (another rank's last), blocks of block_m pairs."""
    local = ids.flatten() - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_experts + 1)[:num_experts]
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    pair_start = counts.cumsum(0) - counts
    index = torch.arange(triton.cdiv(local.numel(), block_m) + min(num_experts, local.numel()))
    expert = torch.searchsorted(block_end, index, right=True)
    clamped = expert.clamp(max=num_experts - 1)
    start = pair_start[clamped] + (index - (block_end - blocks)[clamped]) * block_m
    end = torch.where(expert < num_experts, torch.minimum(start + block_m, pair_start[clamped] + counts[clamped]),
                      start)
    return [order.tolist(), expert.tolist(), start.tolist(), end.tolist()]


@pytest.mark.parametrize("num_experts", [1, 8, 64, 160])
def test_the_layout_kernel_equals_the_stable_sort_in_torch(num_experts: int) -> None:
    """Exactly the torch layout, for every size of step (up to 300 pairs: several of the kernel's pair tiles), block
    size and rank's share of the experts."""
    generator = torch.Generator().manual_seed(num_experts)
    for num_tokens, top_k, block_m in ((1, 1, 16), (1, 8, 16), (5, 2, 4), (16, 8, 16), (37, 8, 32), (300, 1, 16)):
        for first_expert in (0, 3):
            ids = torch.randint(0, num_experts + 6, (num_tokens, top_k), generator=generator)
            got = expert_blocks(ids, first_expert, num_experts, block_m)
            want = reference_blocks(ids, first_expert, num_experts, block_m)
            assert [t.tolist() for t in (got.order, got.expert, got.start, got.end)] == want, (num_tokens, top_k)


def test_expert_blocks_cover_every_pair_once_within_one_expert() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [7, 3], [0, 3], [3, 5]])
    blocks = expert_blocks(ids, first_expert=0, num_experts=8, block_m=2)
    seen = []
    for expert, start, end in zip(blocks.expert.tolist(), blocks.start.tolist(), blocks.end.tolist()):
        if expert == 8:
            assert start == end  # an empty block past the last used one
            continue
        assert 0 < end - start <= 2
        pairs = blocks.order[start:end]
        assert (ids.flatten()[pairs] == expert).all()
        seen += pairs.tolist()
    assert sorted(seen) == list(range(ids.numel()))


def test_expert_blocks_leave_out_another_ranks_experts() -> None:
    ids = torch.tensor([[0, 5], [6, 2], [4, 7]])
    blocks = expert_blocks(ids, first_expert=4, num_experts=2, block_m=4)  # this rank holds experts 4 and 5
    used = [(e, s, t) for e, s, t in zip(blocks.expert.tolist(), blocks.start.tolist(), blocks.end.tolist()) if s < t]
    assert [e for e, _, _ in used] == [0, 1]
    assert sorted(ids.flatten()[blocks.order[s:t]].item() for _, s, t in used) == [4, 5]


@cpu_only
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_interpreter(num_tokens: int, dtype: torch.dtype) -> None:
    layer = moe_layer(hidden=64, inter=32, experts=8, top_k=2, dtype=dtype)
    check_fused(layer, num_tokens, dtype, MoELaunch(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2))


@cpu_only
def test_a_ranks_experts_interpreter() -> None:
    """A rank holding experts 2..5 of 8: the kernel adds exactly what the torch loop adds with the others None."""
    layer = moe_layer(hidden=32, inter=16, experts=8, top_k=3, dtype=torch.float32)
    for j in (0, 1, 6, 7):
        layer.experts[j] = None
    check_fused(layer, 7, torch.float32, MoELaunch(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2))


def test_stacking_keeps_names_values_and_memory() -> None:
    layer = moe_layer(hidden=32, inter=16, experts=4, top_k=2, dtype=torch.float32)
    before = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    layer.fuse_projections()
    stacked = layer.stacked.w13
    layer.fuse_projections()  # idempotent: the graphs' weights stay where they are
    assert layer.stacked.w13 is stacked
    after = layer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert layer.experts[2].up_proj.weight.data_ptr() == stacked[2, 16:].data_ptr()  # views, not copies


def test_uneven_expert_ranges_are_refused() -> None:
    layer = moe_layer(hidden=32, inter=16, experts=4, top_k=2, dtype=torch.float32)
    layer.experts[1] = None
    with pytest.raises(ValueError, match="consecutive"):
        layer.fuse_projections()


# hidden, expert width, experts, top-k: GLM-4.7-Flash, DeepSeek-V2-Lite
GPU_SHAPES = [(2048, 1536, 64, 4), (2048, 1408, 64, 6)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256])
def test_fused_moe_gpu(shape, num_tokens: int) -> None:
    check_fused(moe_layer(*shape, dtype=torch.bfloat16), num_tokens, torch.bfloat16)


@pytest.mark.gpu
def test_fused_moe_cuda_graph() -> None:
    """The whole MoE layer (routing, blocks, both GEMMs) replays from one capture with new inputs."""
    layer = moe_layer(*GPU_SHAPES[0], dtype=torch.bfloat16)
    x = torch.randn(16, GPU_SHAPES[0][0], device=DEVICE, dtype=torch.bfloat16)
    layer.fuse_projections()
    layer.expert_sum(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.expert_sum(x)
    x.normal_()
    graph.replay()
    ids, weights = layer.gate(x)
    want = reference_experts(layer, x, ids, weights) + layer.shared_experts(x)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
