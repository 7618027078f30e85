"""The long-chunk prefill path: the two-part attention against the plain reference, and an engine that prefills
in long chunks against one that prefills through the verify kernels in short ones."""

from __future__ import annotations

import pytest
import torch

from ddtree_kernels.prefill_attention import build_plans, prefill_attention
from ddtree_kernels.reference import prefill_attention_reference
from modeling.tree import DraftTree
from tests.engine_helpers import GREEDY, make_engine, run_to_end
from tests.test_engine import BACKENDS, prompt_of


def paged_problem(prefix_len: int, chunk: int, heads: int, kv_heads: int, dim: int, page_size: int,
                  dtype: torch.dtype, device: str, seed: int = 0):
    """A prefix in shuffled pages (with stale values in the unused slots) and a chunk of queries and K/V."""
    gen = torch.Generator(device).manual_seed(seed)
    num_pages = prefix_len // page_size + 3

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    k_pages, v_pages = randn(num_pages, page_size, kv_heads, dim), randn(num_pages, page_size, kv_heads, dim)
    block_table = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    return (randn(chunk, heads, dim), k_pages, v_pages, block_table, prefix_len, randn(chunk, kv_heads, dim),
            randn(chunk, kv_heads, dim), dim ** -0.5)


@pytest.mark.parametrize("prefix_len", [0, 1, 37, 64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_two_part_attention_equals_the_reference(prefix_len: int, heads: int, kv_heads: int) -> None:
    problem = paged_problem(prefix_len, 21, heads, kv_heads, 16, 16, torch.float32, "cpu")
    torch.testing.assert_close(prefill_attention(*problem), prefill_attention_reference(*problem),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix_len, chunk", [(0, 1000), (3000, 777), (70000, 2048)])
def test_fused_prefill_attention_on_the_gpu(dtype: torch.dtype, prefix_len: int, chunk: int) -> None:
    problem = paged_problem(prefix_len, chunk, 32, 8, 128, 64, dtype, "cuda")
    got = prefill_attention(*problem).float()
    want = prefill_attention_reference(*problem).float()
    assert (got - want).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 4e-3)


def test_plans_are_built_only_for_the_fused_attention() -> None:
    assert build_plans(8, 2, 16, 64, 256, torch.float32, torch.device("cpu")) == 0


@pytest.mark.gpu
def test_plans_cover_every_full_chunk() -> None:
    """The causal chunk, and the prefix of every full chunk of a 4k+1k prompt: 1024, 2048, 3072, 4096."""
    assert build_plans(32, 8, 128, 1024, 4096, torch.bfloat16, torch.device("cuda")) == 5


@pytest.fixture(params=BACKENDS)
def backend(request) -> dict:
    return request.param


def test_long_prefill_chunks_equal_short_ones(tiny_target, backend: dict) -> None:
    """Chunks longer than a tree take the prefill path; the KV they leave and the generation after them are
    those of a prefill in chunks short enough for the verify kernels."""
    long = make_engine(tiny_target, **backend, max_tree_nodes=15, prefill_chunk=100)
    short = make_engine(tiny_target, **backend, max_tree_nodes=15, prefill_chunk=16)
    prompt = prompt_of(250, seed=4)
    outputs = []
    for engine in (long, short):
        session, _ = engine.create_session(prompt, session_id="s")
        engine.start_generation("s", GREEDY)
        outputs.append(run_to_end(engine, "s", lambda _: DraftTree.empty())[0])
    assert long.prefill_chunk == 100 and long.verify_block_tokens == 16
    assert outputs[0] == outputs[1]
    prompt_slots = [long.session("s").block_table.slot(i) for i in range(len(prompt) - 1)]
    for pages_long, pages_short in ((long.kv.k, short.kv.k), (long.kv.v, short.kv.v)):
        flat = [p.flatten(1, 2)[:, prompt_slots] for p in (pages_long, pages_short)]
        torch.testing.assert_close(flat[0], flat[1], atol=1e-3 if backend else 1e-5, rtol=1e-3)


def test_prefill_chunk_defaults() -> None:
    from verifier_service.engine.config import LONG_PREFILL_CHUNK, TRITON_MAX_BLOCK, EngineConfig

    assert EngineConfig().chunk_for(False) == TRITON_MAX_BLOCK  # the CPU
    assert EngineConfig(device="cuda", attention="triton").chunk_for(False) == LONG_PREFILL_CHUNK
    assert EngineConfig(device="cuda", attention="triton").chunk_for(True) == TRITON_MAX_BLOCK
    with pytest.raises(ValueError, match="MLA models prefill in chunks of at most"):
        EngineConfig(device="cuda", attention="triton", prefill_chunk=1024).chunk_for(True)
