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

import ddtree_kernels.fused_moe as fused_moe_module
from ddtree_kernels.fused_moe import MoELaunch, expert_blocks, expert_blocks_by_sort, fused_moe
from modeling.config import ModelConfig
from modeling.moe import MoE, grouped_gemm_experts

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


def layout_of(blocks) -> list[list[int]]:
    return [t.tolist() for t in (blocks.order, blocks.expert, blocks.start, blocks.end)]


@pytest.mark.parametrize("num_experts", [1, 8, 64, 160])
def test_the_layout_kernel_equals_the_stable_sort(num_experts: int) -> None:
    """Exactly the sort's layout, for every size of step (up to 300 pairs: the ranked kernel up to RANKED_MAX_PAIRS,
    in several column tiles at 144, then several of the tiled kernel's pair tiles), block size and rank's share of
    the experts."""
    generator = torch.Generator().manual_seed(num_experts)
    for num_tokens, top_k, block_m in ((1, 1, 16), (1, 8, 16), (5, 2, 4), (16, 8, 16), (16, 9, 16), (37, 8, 32),
                                       (300, 1, 16)):
        for first_expert in (0, 3):
            ids = torch.randint(0, num_experts + 6, (num_tokens, top_k), generator=generator)
            got = expert_blocks(ids, first_expert, num_experts, block_m)
            assert layout_of(got) == layout_of(expert_blocks_by_sort(ids, first_expert, num_experts, block_m))


def test_many_pairs_take_the_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(0, 8, (40, 2), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(fused_moe_module, "LAYOUT_KERNEL_MAX_PAIRS", 79)
    monkeypatch.setattr(fused_moe_module, "_expert_blocks_kernel", None)  # NOTE: any launch would fail
    assert layout_of(expert_blocks(ids, 0, 8, 4)) == layout_of(expert_blocks_by_sort(ids, 0, 8, 4))


LAYOUTS = [expert_blocks, expert_blocks_by_sort]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_blocks_cover_every_pair_once_within_one_expert(layout) -> None:
    ids = torch.tensor([[3, 0], [3, 1], [7, 3], [0, 3], [3, 5]])
    blocks = layout(ids, first_expert=0, num_experts=8, block_m=2)
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
    assert blocks.order.tolist() == [1, 6, 3, 0, 2, 5, 7, 8, 9, 4]  # by expert (0, 1, 3, 5, 7), then pair order


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_blocks_leave_out_another_ranks_experts(layout) -> None:
    ids = torch.tensor([[0, 5], [6, 2], [4, 7]])
    blocks = layout(ids, first_expert=4, num_experts=2, block_m=4)  # this rank holds experts 4 and 5
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


@cpu_only
def test_the_sorted_layout_feeds_the_kernels_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with more pairs than the layout kernel takes: the sort's blocks, the same GEMM kernels."""
    monkeypatch.setattr(fused_moe_module, "LAYOUT_KERNEL_MAX_PAIRS", 8)
    layer = moe_layer(hidden=32, inter=16, experts=8, top_k=3, dtype=torch.float32)
    check_fused(layer, 9, torch.float32, MoELaunch(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("held", [range(8), range(2, 6)])
def test_grouped_gemm_experts_equal_the_torch_loop(dtype: torch.dtype, held: range) -> None:
    """The library's grouped GEMM (a prefill chunk's path on Hopper) adds what the torch loop adds, for a rank
    holding all experts or experts 2..5 of 8 (the others' pairs fall past every group)."""
    layer = moe_layer(hidden=64, inter=32, experts=8, top_k=3, dtype=dtype)
    for j in set(range(8)) - set(held):
        layer.experts[j] = None
    x = torch.randn(50, 64, device=DEVICE).to(dtype)
    ids, weights = layer.gate(x)
    want = reference_experts(layer, x, ids, weights)
    layer.fuse_projections()
    got = grouped_gemm_experts(x, ids, weights, layer.stacked.w13, layer.stacked.w2, layer.stacked.first_expert)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


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


def test_the_shared_expert_joins_the_stack_only_whole_beside_every_expert() -> None:
    """Stacked after the routed experts (views, as they are) when this rank holds every routed expert and the
    shared expert is one expert wide; the CPU path still adds it on its own, unchanged."""
    layer = moe_layer(hidden=32, inter=16, experts=4, top_k=2, dtype=torch.float32)
    x = torch.randn(6, 32, device=DEVICE)
    want = layer.expert_sum(x)
    layer.fuse_projections()
    assert layer.shared_stacked and layer.stacked.w13.shape[0] == 5
    assert layer.shared_experts.down_proj.weight.data_ptr() == layer.stacked.w2[4].data_ptr()
    torch.testing.assert_close(layer.expert_sum(x), want, atol=1e-5, rtol=1e-5)
    part = moe_layer(hidden=32, inter=16, experts=4, top_k=2, dtype=torch.float32)
    part.experts[3] = None  # a tensor-parallel rank's experts 0..2
    part.fuse_projections()
    assert not part.shared_stacked and part.stacked.w13.shape[0] == 3


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
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
def test_the_stacked_shared_expert_on_the_gpu(shape, num_tokens: int) -> None:
    """The whole layer with the shared expert as one more fused pair per token (4096 tokens: the grouped GEMM
    where it runs) against the torch loop plus the shared MLP."""
    layer = moe_layer(*shape, dtype=torch.bfloat16)
    x = torch.randn(num_tokens, shape[0], device=DEVICE, dtype=torch.bfloat16)
    want = layer.expert_sum(x)
    layer.fuse_projections()
    assert layer.shared_stacked
    torch.testing.assert_close(layer.expert_sum(x), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_a_prefill_chunks_experts_on_the_gpu(shape) -> None:
    """4096 tokens: more pairs than the fused kernel is used for (the grouped GEMM where it runs)."""
    layer = moe_layer(*shape, dtype=torch.bfloat16)
    x = torch.randn(4096, shape[0], device=DEVICE, dtype=torch.bfloat16)
    ids, weights = layer.gate(x)
    want = reference_experts(layer, x, ids, weights)
    layer.fuse_projections()
    torch.testing.assert_close(layer.run_experts(x, ids, weights), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [16, 2048])
def test_fused_moe_cuda_graph(num_tokens: int) -> None:
    """The whole MoE layer (routing, blocks, both GEMMs) replays from one capture with new inputs, at a verify
    step's size and at the largest batch's (8192 pairs: the sorted layout, the grouped GEMM where it runs)."""
    layer = moe_layer(*GPU_SHAPES[0], dtype=torch.bfloat16)
    x = torch.randn(num_tokens, GPU_SHAPES[0][0], device=DEVICE, dtype=torch.bfloat16)
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
