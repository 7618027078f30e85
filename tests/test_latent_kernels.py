"""The MLA verify kernel and the latent commit against the plain-torch oracle (ddtree_kernels/reference.py).

Without CUDA the kernel runs in Triton's CPU interpreter (fp16/fp32, small latents: the interpreter gives wrong
bf16 dot products); with CUDA the `gpu` tests run bf16 and fp16 at the real models' 512 + 64 entries.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_kernels import latent_prefix_sm90
from ddtree_kernels.commit_kv import commit_kv
from ddtree_kernels.latent_verify import default_latent_config, latent_verify_attention
from ddtree_kernels.reference import commit_rows_reference, latent_verify_attention_reference, pack_tree_mask
from ddtree_kernels.split_kv import SplitConfig
from tests.test_kernels import TOL, paged_kv, random_tree_mask

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on CPU machines")
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]


def latent_case(lens: list[int], trees: list[int], heads: int, lora: int, rope: int, page_size: int,
                dtype: torch.dtype, seed: int, poison_stale: bool = False, head_major: bool = False) -> dict:
    """Arguments of `latent_verify_attention_reference` for sessions with prefix `lens` and tree sizes `trees`;
    with `poison_stale`, every page slot past a sequence's prefix holds NaN (stale slots must never be read); with
    `head_major`, q [N, H, C] is laid out head by head, as `modeling.mla.MLAttention` builds it."""
    gen = torch.Generator().manual_seed(seed)
    pages, _, tables = paged_kv(lens, page_size, 1, lora + rope, dtype, gen)
    if poison_stale:
        used = torch.zeros(pages.shape[0] * page_size, dtype=torch.bool)
        for table, n in zip(tables, lens):
            slots = table.long()[torch.arange(n) // page_size] * page_size + torch.arange(n) % page_size
            used[slots] = True
        pages.view(-1, lora + rope)[~used] = float("nan")
    num_tokens = sum(trees)
    q = (torch.randn(num_tokens, heads, lora + rope, generator=gen) * 0.3).to(dtype)
    if head_major:
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    scratch = torch.randn(num_tokens + 3, 1, lora + rope, generator=gen).to(dtype)  # the engine's [N, 1, C] rows
    words = max(1, (max(trees) + 31) // 32)
    masks = [pack_tree_mask(random_tree_mask(t, gen)) for t in trees]
    tree_mask = torch.cat([torch.nn.functional.pad(m, (0, words - m.shape[1])) for m in masks])
    args = dict(q=q, pages=pages, block_tables=tables, prefix_lens=torch.tensor(lens, dtype=torch.int32),
                tree_entries=scratch[:num_tokens, 0],
                cu_tree=torch.tensor([0, *torch.tensor(trees).cumsum(0).tolist()], dtype=torch.int32),
                tree_mask=tree_mask, sm_scale=(lora // 4 + rope) ** -0.5, value_dim=lora)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def check_latent(case: dict, lens: list[int], trees: list[int], cfg: SplitConfig | None = None,
                 max_prefix_len: int | None = None) -> None:
    bound = max(lens) if max_prefix_len is None else max_prefix_len
    out = latent_verify_attention(**case, max_prefix_len=bound, max_tree_len=max(trees), cfg=cfg)
    clean = {**case, "pages": torch.nan_to_num(case["pages"])}  # the oracle reads only real slots anyway
    ref = latent_verify_attention_reference(**clean)
    assert out.dtype == case["q"].dtype and out.shape == (*case["q"].shape[:2], case["value_dim"])
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def small(**overrides: int) -> SplitConfig:
    return SplitConfig(**{**dict(block_m=32, block_n=16, num_warps=4, num_stages=2, programs_per_sm=2), **overrides})


# lens, trees, heads, lora, rope, page size, dtype, config
CPU_CASES = [
    ([37, 0, 100], [5, 3, 0], 4, 32, 8, 16, torch.float16, small()),
    ([200, 77], [7, 1], 2, 16, 16, 64, torch.float32, small(block_n=32)),
    ([130], [40], 3, 32, 8, 16, torch.float16, None),  # rows of one token split across query blocks
    ([0, 5], [9, 1], 4, 16, 8, 16, torch.float32, small(block_m=16)),
]


@cpu_only
@pytest.mark.parametrize("lens,trees,heads,lora,rope,page_size,dtype,cfg", CPU_CASES)
def test_latent_verify_interpreter(lens, trees, heads, lora, rope, page_size, dtype, cfg):
    case = latent_case(lens, trees, heads, lora, rope, page_size, dtype, seed=len(lens) + lora, poison_stale=True)
    check_latent(case, lens, trees, cfg)


@cpu_only
def test_one_launch_shape_serves_shorter_prefixes_interpreter():
    """The bound picks the split count; shorter prefixes cut their own chunks on the device."""
    lens, trees = [70, 3], [4, 2]
    case = latent_case(lens, trees, 2, 16, 8, 16, torch.float32, seed=5)
    check_latent(case, lens, trees, small(), max_prefix_len=4096)


@cpu_only
def test_head_major_queries_interpreter():
    lens, trees = [37, 100], [5, 3]
    case = latent_case(lens, trees, 4, 32, 8, 16, torch.float16, seed=9, poison_stale=True, head_major=True)
    assert not case["q"].is_contiguous()
    check_latent(case, lens, trees, small())


@cpu_only
def test_latent_wrapper_rejects_bad_inputs():
    case = latent_case([20], [3], 2, 16, 8, 16, torch.float16, seed=0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        latent_verify_attention(**{**case, "value_dim": 24}, max_prefix_len=20, max_tree_len=3)
    with pytest.raises(ValueError, match="dtype"):
        latent_verify_attention(**{**case, "q": case["q"].float()}, max_prefix_len=20, max_tree_len=3)
    with pytest.raises(ValueError, match="tree_mask"):
        latent_verify_attention(**case, max_prefix_len=20, max_tree_len=40)


def check_latent_commit(dtype: torch.dtype, layers: int) -> None:
    gen = torch.Generator().manual_seed(3)
    pages = torch.randn(layers, 6, 16, 1, 40, generator=gen).to(dtype).to(DEVICE)
    scratch = torch.randn(layers, 9, 1, 40, generator=gen).to(dtype).to(DEVICE)
    src = torch.tensor([0, 4, 5, 8], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([3 * 16 + 15, 5 * 16, 5 * 16 + 1, 0], dtype=torch.int64, device=DEVICE)
    expected = pages.clone()
    commit_rows_reference(expected, scratch, src, dst)
    commit_kv(pages, None, scratch, None, src, dst)
    assert torch.equal(pages, expected)
    with pytest.raises(ValueError, match="both"):
        commit_kv(pages, None, scratch, scratch, src, dst)


@cpu_only
def test_latent_commit_interpreter():
    check_latent_commit(torch.float16, layers=2)


# lens, trees, heads, page size: the real models' 512 + 64 entries
GPU_CASES = [
    ([1000, 0, 4097, 333], [64, 7, 1, 16], 16, 64),
    ([5000, 63], [16, 64], 20, 64),
    ([2049, 17], [7, 1], 128, 64),
    ([70000], [16], 64, 64),
    ([900, 129], [33, 5], 16, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,trees,heads,page_size", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["default", "triton"])  # default: the warpgroup-MMA prefix on sm_90
def test_latent_verify_gpu(lens, trees, heads, page_size, dtype, kernel):
    case = latent_case(lens, trees, heads, 512, 64, page_size, dtype, seed=len(lens), poison_stale=True)
    rows = heads * max(trees)
    if kernel == "default" and torch.cuda.get_device_capability()[0] == 9:
        assert latent_prefix_sm90.supports(case["q"], 512, rows) == (rows >= 64)
    check_latent(case, lens, trees, default_latent_config(rows, 512) if kernel == "triton" else None)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,trees,heads,page_size", GPU_CASES[:2])
def test_head_major_queries_gpu(lens, trees, heads, page_size):
    """The layout the MLA layer passes (q head by head) through the warpgroup-MMA prefix and the tree kernel."""
    case = latent_case(lens, trees, heads, 512, 64, page_size, torch.bfloat16, seed=11, poison_stale=True,
                       head_major=True)
    check_latent(case, lens, trees)


@pytest.mark.gpu
def test_latent_commit_gpu():
    check_latent_commit(torch.bfloat16, layers=47)


@pytest.mark.gpu
def test_latent_verify_cuda_graph_any_prefix_len():
    """One capture at a 128k bound replays correctly for any prefix lengths below it (and a 1-token block)."""
    trees = [16, 1]
    bound = 131072
    case = latent_case([bound, bound], trees, 16, 512, 64, 64, torch.bfloat16, seed=9)
    lens = case["prefix_lens"]
    run = lambda: latent_verify_attention(**case, max_prefix_len=bound, max_tree_len=16)
    lens.copy_(torch.tensor([5, 7], dtype=torch.int32))
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    atol, rtol = TOL[torch.bfloat16]
    for step in ([16000, 0], [131072, 64], [0, 0], [1000, 99999]):
        lens.copy_(torch.tensor(step, dtype=torch.int32))
        case["q"].normal_(std=0.3)
        graph.replay()
        ref = latent_verify_attention_reference(**case)
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)

