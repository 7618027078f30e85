"""Triton kernels against the plain-torch oracle in ddtree_kernels/reference.py.

Without CUDA the kernels run in Triton's CPU interpreter (fp16/fp32, small shapes: the interpreter
gives wrong bf16 dot products); with CUDA the `gpu` tests run bf16 at larger shapes.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from ddtree_kernels.commit_kv import commit_kv
from ddtree_kernels.lse_merge import MAX_BLOCK_D, MAX_BLOCK_S, merge_partials
from ddtree_kernels.reference import (
    commit_kv_reference,
    gather_prefix,
    pack_tree_mask,
    verify_attention_reference,
)
from ddtree_kernels.split_kv import (
    MIN_SPLIT_BLOCKS,
    SplitConfig,
    SplitPlan,
    attention_partials,
    default_config,
    plan_splits,
)
from ddtree_kernels.verify_attention import hybrid_verify_attention

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on CPU machines")
# NOTE: the interpreter also computes the padding rows of a tile, where 0/0 is harmless and never stored.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1.5e-2, 2e-2)}


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def small_config(**overrides: int) -> SplitConfig:
    """Interpreter-sized launch shapes: small key blocks so short prefixes still span several blocks."""
    return SplitConfig(**{**dict(block_m=128, block_n=64, num_warps=4, num_stages=2, programs_per_sm=2), **overrides})


def random_tree_mask(size: int, gen: torch.Generator) -> torch.Tensor:
    """`[size, size]` bool: each node sees itself and its ancestors; parent index < own index."""
    mask = torch.eye(size, dtype=torch.bool)
    for node in range(1, size):
        parent = int(torch.randint(0, node, (1,), generator=gen))
        mask[node] = mask[parent]
        mask[node, node] = True
    return mask


def paged_kv(lens: list[int], page_size: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """Pages in shuffled order, block tables padded with real (unused) page ids to catch over-reads."""
    max_pages = max(1, max((n + page_size - 1) // page_size for n in lens)) + 1
    num_pages = len(lens) * max_pages + 2
    k_pages = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype)
    v_pages = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype)
    tables = torch.randperm(num_pages, generator=gen)[: len(lens) * max_pages].view(len(lens), max_pages)
    return k_pages, v_pages, tables.to(torch.int32)


def verify_case(lens: list[int], trees: list[int], hq: int, hkv: int, d: int, page_size: int,
                dtype: torch.dtype, seed: int) -> dict:
    """Arguments of `verify_attention_reference` for sessions with prefix `lens` and tree sizes `trees`."""
    gen = torch.Generator().manual_seed(seed)
    k_pages, v_pages, tables = paged_kv(lens, page_size, hkv, d, dtype, gen)
    num_tokens = sum(trees)
    qkv = torch.randn(num_tokens, hq + 2 * hkv, d, generator=gen).to(dtype)  # strided q, as from a qkv proj
    words = max(1, (max(trees) + 31) // 32)
    masks = [pack_tree_mask(random_tree_mask(t, gen)) for t in trees]
    tree_mask = torch.cat([torch.nn.functional.pad(m, (0, words - m.shape[1])) for m in masks])
    args = dict(
        q=qkv[:, :hq], k_pages=k_pages, v_pages=v_pages, block_tables=tables,
        prefix_lens=torch.tensor(lens, dtype=torch.int32), tree_k=qkv[:, hq:hq + hkv],
        tree_v=qkv[:, hq + hkv:], cu_tree=torch.tensor([0, *torch.tensor(trees).cumsum(0).tolist()],
                                                        dtype=torch.int32),
        tree_mask=tree_mask, sm_scale=d**-0.5,
    )
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def check_verify(case: dict, lens: list[int], trees: list[int], cfg: SplitConfig | None = None,
                 max_prefix_len: int | None = None) -> None:
    bound = max(lens) if max_prefix_len is None else max_prefix_len
    out = hybrid_verify_attention(**case, max_prefix_len=bound, max_tree_len=max(trees), cfg=cfg)
    ref = verify_attention_reference(**case)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# lens, trees, (hq, hkv), d, page size, dtype, config
CPU_VERIFY = [
    ([37, 0, 100], [5, 3, 0], (8, 2), 32, 16, torch.float16, small_config(block_n=16)),
    ([200, 77], [7, 1], (4, 4), 64, 64, torch.float32, small_config(block_n=16)),
    ([130], [64], (8, 1), 32, 64, torch.float16, small_config(block_m=64, block_n=32)),
    ([45, 3], [200, 17], (4, 1), 16, 16, torch.float16, None),
    ([0, 0], [7, 33], (2, 2), 16, 16, torch.float32, None),
]


@cpu_only
@pytest.mark.parametrize("lens,trees,heads,d,page_size,dtype,cfg", CPU_VERIFY)
def test_verify_attention_interpreter(lens, trees, heads, d, page_size, dtype, cfg):
    check_verify(verify_case(lens, trees, *heads, d, page_size, dtype, seed=len(lens) + d), lens, trees, cfg)


@cpu_only
@pytest.mark.parametrize("seed", range(4))
def test_verify_attention_random_interpreter(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]
    num_seqs = 1 + seed % 3
    lens = [int(torch.randint(0, 300, (1,), generator=gen)) for _ in range(num_seqs)]
    trees = [pick([1, 7, 64, 200]) for _ in range(num_seqs)]
    hkv, group = pick([1, 2]), pick([1, 4, 8])
    dtype = pick([torch.float16, torch.float32])
    case = verify_case(lens, trees, hkv * group, hkv, 16, pick([16, 64]), dtype, seed=seed)
    check_verify(case, lens, trees, small_config(block_n=pick([16, 64]), tma=pick([False, True])))


def poison_stale_slots(case: dict, lens: list[int]) -> None:
    """NaN in every page slot no sequence owns: stale pool memory that masked blocks must not let in."""
    for pages in (case["k_pages"], case["v_pages"]):
        live = torch.zeros(pages.shape[:2], dtype=torch.bool, device=pages.device)  # [num_pages, P]
        for b, n in enumerate(lens):
            pos = torch.arange(n, device=pages.device)
            live[case["block_tables"][b].long()[pos // pages.shape[1]], pos % pages.shape[1]] = True
        pages[~live] = float("nan")


@cpu_only
@pytest.mark.parametrize("tma", [False, True])
def test_verify_attention_stale_nan_slots_interpreter(tma):
    lens, trees = [37, 0, 100, 64], [5, 3, 9, 2]
    case = verify_case(lens, trees, 8, 2, 32, 64, torch.float16, seed=9)
    poison_stale_slots(case, lens)
    check_verify(case, lens, trees, small_config(block_n=32, tma=tma), max_prefix_len=1000)


# Plain decoding: trees of one row (or none: a bucket's padding) attended by the last prefix split; with one
# split per tile its output is the result (no merge), with several the merge finds the tree in the last one.
@cpu_only
@pytest.mark.parametrize("programs_per_sm,splits", [(1, 1), (16, 6)])
@pytest.mark.parametrize("tma", [False, True])
def test_plain_decoding_attention_interpreter(programs_per_sm: int, splits: int, tma: bool):
    lens, trees, bound = [37, 0, 100, 5, 64], [1, 1, 1, 0, 1], 1000
    cfg = small_config(block_n=16, programs_per_sm=programs_per_sm, tma=tma)
    assert plan_splits(len(lens), 2, 4, bound, DEVICE, cfg).num_splits == splits
    case = verify_case(lens, trees, 8, 2, 32, 16, torch.float16, seed=13)
    poison_stale_slots(case, lens)
    check_verify(case, lens, trees, cfg, max_prefix_len=bound)


@cpu_only
def test_plain_decoding_without_any_prefix_interpreter():
    """A bound of 0 plans no prefix split: split 0's program attends the own key alone and writes the output."""
    lens, trees = [0, 0], [1, 1]
    assert plan_splits(2, 2, 4, 0, DEVICE, small_config()).num_splits == 0
    check_verify(verify_case(lens, trees, 8, 2, 32, 16, torch.float16, seed=4), lens, trees, small_config(),
                 max_prefix_len=0)


def test_only_a_launch_with_one_partial_writes_the_output():
    lens, trees = [40, 3], [1, 1]
    case = verify_case(lens, trees, 4, 2, 16, 16, torch.float32, seed=2)
    plan = SplitPlan(block_m=16, num_m_blocks=1, num_splits=2, block_n=16)
    tree = (case["tree_k"], case["tree_v"], case["tree_mask"])
    with pytest.raises(ValueError, match="one partial"):
        attention_partials(case["q"], case["k_pages"], case["v_pages"], case["block_tables"], case["prefix_lens"],
                           case["cu_tree"], case["sm_scale"], plan, small_config(block_n=16), tree, 1,
                           torch.empty_like(case["q"]))


# The engine captures one launch per (batch, tokens) bucket at max_prefix_len = max_context: the bound
# only sizes the grid, each sequence cuts its own prefix into chunks on the device.
@cpu_only
@pytest.mark.parametrize("lens,trees,heads,page_size,dtype,bound", [
    ([37, 0, 100, 5], [5, 3, 9, 1], (8, 2), 16, torch.float16, 131072),
    ([0, 211, 64], [7, 1, 16], (4, 4), 64, torch.float32, 20000),
    ([0], [12], (4, 1), 16, torch.float16, 4096),
])
def test_verify_attention_bound_above_lengths_interpreter(lens, trees, heads, page_size, dtype, bound):
    case = verify_case(lens, trees, *heads, 32, page_size, dtype, seed=sum(lens))
    check_verify(case, lens, trees, small_config(block_n=16), max_prefix_len=bound)


@cpu_only
def test_prefix_chunks_spread_over_every_split_interpreter():
    """Under a bound far above the real lengths, split i of a sequence holds keys [i * c, (i + 1) * c),
    c = max(cdiv(cdiv(len, block_n), num_splits), MIN_SPLIT_BLOCKS) * block_n: the prefix spreads over the
    splits, two blocks to a split at least."""
    lens, trees, block_n, num_splits = [0, 37, 200, 1000], [3, 2, 4, 1], 16, 5
    case = verify_case(lens, trees, 4, 2, 32, 16, torch.float32, seed=11)
    plan = SplitPlan(block_m=16, num_m_blocks=1, num_splits=num_splits, block_n=block_n)
    cfg = small_config(block_m=16, block_n=block_n)
    part_o, part_lse = attention_partials(case["q"], case["k_pages"], case["v_pages"], case["block_tables"],
                                          case["prefix_lens"], case["cu_tree"], case["sm_scale"], plan, cfg)
    for b, n in enumerate(lens):
        lo, hi = int(case["cu_tree"][b]), int(case["cu_tree"][b + 1])
        chunk = max(MIN_SPLIT_BLOCKS.value, cdiv(cdiv(n, block_n), num_splits)) * block_n
        used = cdiv(n, chunk)
        assert used == min(num_splits, cdiv(n, MIN_SPLIT_BLOCKS.value * block_n))
        keys = gather_prefix(case["k_pages"], case["block_tables"][b], n).repeat_interleave(2, dim=1)
        values = gather_prefix(case["v_pages"], case["block_tables"][b], n).repeat_interleave(2, dim=1)
        for split in range(used):
            span = slice(split * chunk, min(n, (split + 1) * chunk))
            scores = torch.einsum("thd,shd->hts", case["q"][lo:hi], keys[span]) * case["sm_scale"]
            want = torch.einsum("hts,shd->thd", scores.softmax(-1), values[span])
            torch.testing.assert_close(part_o[split, lo:hi], want, atol=1e-4, rtol=1e-4)
            lse = scores.logsumexp(-1).transpose(0, 1) * 1.4426950408889634  # log2 domain, [T, Hq]
            torch.testing.assert_close(part_lse[split, lo:hi], lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("d,folded", [(32, False), (4 * MAX_BLOCK_D, False), (32, True)])
def test_merge_folds_only_written_partials_across_tiles(d: int, folded: bool):
    """More splits than one merge tile holds; a sequence with no prefix has only its tree partial, and
    partials of splits that held no keys (never written: NaN here) are skipped, not folded in. MLA's 512-wide
    rows take one program per column block. A folded tree (plain decoding) has no partial of its own: the last
    prefix split holds it, split 0 without a prefix."""
    num_splits, block_n, hq = MAX_BLOCK_S + 6, 16, 3
    lens = [0, MIN_SPLIT_BLOCKS.value * block_n * num_splits + 5, 100]  # no prefix, every split, 4 splits
    trees = [1, 1, 1] if folded else [2, 3, 1]
    gen = torch.Generator().manual_seed(3)
    part_o = torch.randn(num_splits + 1, sum(trees), hq, d, generator=gen)
    part_lse = 4 * torch.randn(num_splits + 1, sum(trees), hq, generator=gen)
    cu_q = torch.tensor([0, *itertools.accumulate(trees)], dtype=torch.int32)
    want = torch.empty(sum(trees), hq, d)
    for b, n in enumerate(lens):
        chunk = max(MIN_SPLIT_BLOCKS.value, cdiv(cdiv(n, block_n), num_splits)) * block_n
        prefix_splits = min(cdiv(n, chunk), num_splits)
        used = [*range(max(prefix_splits, 1))] if folded else [*range(prefix_splits), num_splits]
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        unused = [split for split in range(num_splits) if split not in used]
        part_o[unused, rows], part_lse[unused, rows] = float("nan"), float("nan")
        weights = torch.softmax(part_lse[used, rows] * 0.6931471805599453, dim=0)  # log2 -> natural log
        want[rows] = (weights[..., None] * part_o[used, rows]).sum(0)
    plan = SplitPlan(block_m=16, num_m_blocks=1, num_splits=num_splits, block_n=block_n)
    out = merge_partials(part_o.to(DEVICE), part_lse.to(DEVICE), cu_q.to(DEVICE),
                         torch.tensor(lens, dtype=torch.int32, device=DEVICE), plan, True, max(trees), torch.float32,
                         folded)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)


def check_one_plan_many_lengths(lens_per_replay: list[list[int]], trees: list[int], bound: int,
                                dtype: torch.dtype, heads: tuple[int, int], d: int, page_size: int,
                                cfg: SplitConfig | None, graph: bool) -> None:
    """What CUDA-graph replay does: one plan and one set of launch arguments (the same tensors), new
    prefix lengths written in place before each run. Pages cover the longest lengths."""
    longest = [max(step[b] for step in lens_per_replay) for b in range(len(trees))]
    case = verify_case(longest, trees, *heads, d, page_size, dtype, seed=5)
    prefix_lens = case["prefix_lens"]
    run = lambda: hybrid_verify_attention(**case, max_prefix_len=bound, max_tree_len=max(trees), cfg=cfg)
    if graph:
        torch.cuda.synchronize()
        run()  # compile outside the capture
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            out = run()
    for lens in lens_per_replay:
        prefix_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        if graph:
            cuda_graph.replay()
        else:
            out = run()
        ref = verify_attention_reference(**case)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol, msg=f"prefix_lens {lens}")


@cpu_only
def test_one_plan_many_prefix_lengths_interpreter():
    cfg = small_config(block_n=16, programs_per_sm=4)
    assert plan_splits(2, 1, 8 * 6, 8192, DEVICE, cfg).num_splits == 8  # the bound picks the splits
    steps = [[300, 0], [0, 5], [16, 290], [163, 17], [299, 300]]
    check_one_plan_many_lengths(steps, [4, 6], 8192, torch.float16, (8, 1), 32, 16, cfg, graph=False)


def check_commit(dtype: torch.dtype, layers: int = 3) -> None:
    gen = torch.Generator().manual_seed(7)
    pages = torch.randn(2, layers, 6, 16, 2, 32, generator=gen).to(dtype).to(DEVICE)
    tree = torch.randn(2, layers, 9, 2, 32, generator=gen).to(dtype).to(DEVICE)
    src = torch.tensor([0, 4, 5, 8], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([3 * 16 + 15, 5 * 16, 5 * 16 + 1, 0], dtype=torch.int64, device=DEVICE)
    expected = pages.clone()
    commit_kv_reference(expected[0], expected[1], tree[0], tree[1], src, dst)
    commit_kv(pages[0], pages[1], tree[0], tree[1], src, dst)
    assert torch.equal(pages, expected)


@cpu_only
def test_commit_kv_interpreter():
    check_commit(torch.float16)


@cpu_only
def test_wrappers_reject_bad_inputs():
    case = verify_case([20], [3], 4, 2, 16, 16, torch.float16, seed=0)
    with pytest.raises(ValueError, match="block_tables"):
        hybrid_verify_attention(**{**case, "block_tables": case["block_tables"].long()}, max_prefix_len=20,
                                max_tree_len=3)
    with pytest.raises(ValueError, match="tree_mask"):
        hybrid_verify_attention(**case, max_prefix_len=20, max_tree_len=40)
    with pytest.raises(ValueError, match="dtype"):
        hybrid_verify_attention(**{**case, "q": case["q"].float()}, max_prefix_len=20, max_tree_len=3)


GPU_VERIFY = [
    ([1000, 0, 4097, 333], [64, 7, 1, 200], (32, 8), 128, 64),
    ([5000, 63], [200, 64], (16, 16), 64, 16),
    ([2049, 17, 900], [7, 64, 1], (32, 4), 256, 16),
    ([2049, 17, 900], [7, 64, 1], (32, 4), 256, 64),
    ([70000], [16], (32, 8), 128, 64),
    ([0, 129], [33, 5], (8, 1), 128, 64),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lens,trees,heads,d,page_size", GPU_VERIFY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_attention_gpu(lens, trees, heads, d, page_size, dtype):
    check_verify(verify_case(lens, trees, *heads, d, page_size, dtype, seed=len(lens)), lens, trees)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sessions", [4, 72])  # NOTE: 72 x 8 KV heads fill an H100's or H200's grid: one split
def test_plain_decoding_attention_gpu(sessions: int):
    gen = torch.Generator().manual_seed(sessions)
    lens = torch.randint(0, 3000, (sessions,), generator=gen).tolist()
    trees = [1] * (sessions - 1) + [0]
    case = verify_case(lens, trees, 16, 8, 128, 64, torch.bfloat16, seed=sessions)
    poison_stale_slots(case, lens)
    check_verify(case, lens, trees, max_prefix_len=40960)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("trees", [[64, 7, 1, 200], [16, 3, 1, 9]])
def test_verify_attention_paths_stale_nan_slots_gpu(tma, trees):
    """Both K/V load paths (TMA boxes and pointer gathers) at both default tile families, NaN in stale slots."""
    lens = [1000, 0, 4097, 333]
    case = verify_case(lens, trees, 32, 8, 128, 64, torch.bfloat16, seed=4)
    poison_stale_slots(case, lens)
    cfg = dataclasses.replace(default_config(4 * max(trees), 128), tma=tma)
    check_verify(case, lens, trees, cfg, max_prefix_len=8192)


@pytest.mark.gpu
@needs_gpu
def test_commit_kv_gpu():
    check_commit(torch.bfloat16, layers=36)


@pytest.mark.gpu
@needs_gpu
def test_verify_attention_cuda_graph():
    """The wrapper must be capturable: no host sync, sizes from the host-side bounds only."""
    lens, trees = [3000, 100], [16, 64]
    case = verify_case(lens, trees, 32, 8, 128, 64, torch.bfloat16, seed=3)
    run = lambda: hybrid_verify_attention(**case, max_prefix_len=4096, max_tree_len=64)
    torch.cuda.synchronize()
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    case["q"].normal_()
    graph.replay()
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.float(), verify_attention_reference(**case).float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("trees", [[16, 16], [64, 3]])
def test_verify_attention_cuda_graph_any_prefix_len(trees):
    """One capture at the engine's max_context bound replays correctly for any prefix lengths below it."""
    steps = [[16000, 0], [5, 70001], [131072, 64], [0, 0], [1000, 999]]
    check_one_plan_many_lengths(steps, trees, 131072, torch.bfloat16, (32, 8), 128, 64, None, graph=True)

