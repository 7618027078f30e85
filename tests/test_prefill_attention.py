"""The long-chunk prefill path: the two-part attention against the plain reference, and an engine that prefills
in long chunks against one that prefills through the verify kernels in short ones."""

from __future__ import annotations

import pytest
import torch

from ddtree_kernels.prefill_attention import (
    build_latent_plans,
    build_plans,
    latent_prefill_attention,
    latent_segments,
    prefill_attention,
)
from ddtree_kernels.reference import latent_prefill_attention_reference, prefill_attention_reference
from modeling.tiny import make_tiny_target
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


def latent_problem(prefix_len: int, chunk: int, heads: int, dtype: torch.dtype, device: str, rank: int = 32,
                   nope: int = 16, rope: int = 8, values: int = 16, page_size: int = 16):
    """An MLA layer's prefill: a latent prefix in shuffled pages, the chunk's rotated queries and entries, and
    kv_b_proj's halves."""
    gen = torch.Generator(device).manual_seed(prefix_len + chunk)

    def randn(*shape, scale: float = 1.0):
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    num_pages = prefix_len // page_size + 3
    block_table = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    return (randn(chunk, heads, nope), randn(chunk, heads, rope), randn(num_pages, page_size, 1, rank + rope),
            block_table, prefix_len, randn(chunk, rank + rope), randn(heads, nope, rank, scale=rank ** -0.5),
            randn(heads, values, rank, scale=rank ** -0.5), (nope + rope) ** -0.5)


@pytest.mark.parametrize("prefix_len", [0, 5, 50])
def test_expanded_latent_prefill_equals_the_absorbed_reference(prefix_len: int) -> None:
    """Expanded per-head keys and values (the prefix 16 tokens at a time, merged) give what the absorbed form
    gives."""
    problem = latent_problem(prefix_len, 19, 4, torch.float32, "cpu")
    torch.testing.assert_close(latent_prefill_attention(*problem, segment=16),
                               latent_prefill_attention_reference(*problem), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix_len, chunk, heads", [(0, 1000, 20), (5000, 777, 16), (40000, 2048, 20)])
def test_expanded_latent_prefill_on_the_gpu(dtype: torch.dtype, prefix_len: int, chunk: int, heads: int) -> None:
    problem = latent_problem(prefix_len, chunk, heads, dtype, "cuda", rank=512, nope=128, rope=64, values=128,
                             page_size=64)
    got = latent_prefill_attention(*problem, segment=16384).float()
    want = latent_prefill_attention_reference(*problem).float()
    assert (got - want).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 4e-3)


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
    w_uk, w_uv = torch.zeros(4, 16, 32), torch.zeros(4, 16, 32)
    assert build_latent_plans(w_uk, w_uv, 8, 64, 256) == 0


@pytest.mark.parametrize("chunk, max_prefix, segment, lengths", [
    (1024, 4096, 32768, [1024, 2048, 3072, 4096]),  # every prefix one segment
    (1024, 5120, 2048, [1024, 2048]),  # full segments, then what is left of each prefix
    (1000, 5000, 3000, [1000, 2000, 3000]),  # 4000 = 3000 + 1000, 5000 = 3000 + 2000
    (4096, 4095, 32768, []),  # no prefix a full chunk meets
])
def test_latent_segments_are_those_the_expanded_prefill_takes(chunk: int, max_prefix: int, segment: int,
                                                              lengths: list[int]) -> None:
    assert latent_segments(chunk, max_prefix, segment) == lengths
    taken = {min(segment, prefix - start) for prefix in range(chunk, max_prefix + 1, chunk)
             for start in range(0, prefix, segment)}  # NOTE: latent_prefill_attention's loop over the prefix
    assert taken == set(lengths)


@pytest.mark.gpu
def test_plans_cover_every_full_chunk() -> None:
    """The causal chunk, and the prefix of every full chunk of a 4k+1k prompt: 1024, 2048, 3072, 4096."""
    assert build_plans(32, 8, 128, 1024, 4096, torch.bfloat16, torch.device("cuda")) == 5


@pytest.mark.gpu
def test_an_mla_engine_builds_its_expanded_prefill_plans_at_warm_up(tiny_mla_target) -> None:
    """The causal chunk and the prefix segments of every full 300-token chunk of a 2000-token context (300 .. 1500)."""
    engine = make_engine(tiny_mla_target, device="cuda", attention="triton", dtype="bfloat16", prefill_chunk=300,
                         max_context=2000)
    assert engine._build_prefill_plans() == 1 + len(latent_segments(300, 1700, 32768)) == 6


@pytest.fixture(params=BACKENDS)
def backend(request) -> dict:
    return request.param


@pytest.fixture(scope="module")
def tiny_mla_target(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny-mla"), seed=0, arch="deepseek_v3")


@pytest.mark.parametrize("model, long_chunk, short_chunk, prompt_len", [("dense", 100, 16, 250),
                                                                        ("mla", 300, 16, 700)])
def test_long_prefill_chunks_equal_short_ones(request, backend: dict, model: str, long_chunk: int, short_chunk: int,
                                              prompt_len: int) -> None:
    """Chunks longer than a tree (for MLA: longer than the latent verify kernel takes) take the prefill path; the
    KV they leave and the generation after them are those of a prefill in chunks short enough for the verify
    kernels. A long chunk writes its K/V to its pages itself: the tree scratch holds a step's rows, not a chunk."""
    target = request.getfixturevalue("tiny_target" if model == "dense" else "tiny_mla_target")
    long = make_engine(target, **backend, max_tree_nodes=15, prefill_chunk=long_chunk, max_batch_tokens=32)
    short = make_engine(target, **backend, max_tree_nodes=15, prefill_chunk=short_chunk)
    prompt = prompt_of(prompt_len, seed=4)
    outputs = []
    for engine in (long, short):
        engine.create_session(prompt, session_id="s")
        engine.start_generation("s", GREEDY)
        outputs.append(run_to_end(engine, "s", lambda _: DraftTree.empty())[0])
    assert long.prefill_chunk == long_chunk < prompt_len and long.verify_block_tokens < long_chunk
    assert long.scratch.k.shape[1] == max(32, long.verify_block_tokens) < long_chunk
    assert outputs[0] == outputs[1]
    prompt_slots = [long.session("s").block_table.slot(i) for i in range(len(prompt) - 1)]
    for pages_long, pages_short in ((long.kv.k, short.kv.k), (long.kv.v, short.kv.v)):
        if pages_long is None:  # NOTE: an MLA cache has no V pages
            continue
        flat = [p.flatten(1, 2)[:, prompt_slots] for p in (pages_long, pages_short)]
        torch.testing.assert_close(flat[0], flat[1], atol=1e-3 if backend else 1e-5, rtol=1e-3)


def test_prefill_chunk_defaults() -> None:
    from verifier_service.engine.config import LONG_PREFILL_CHUNK, TRITON_MAX_BLOCK, EngineConfig

    assert EngineConfig().prefill_chunk_tokens == TRITON_MAX_BLOCK  # the CPU
    assert EngineConfig(device="cuda", attention="triton").prefill_chunk_tokens == LONG_PREFILL_CHUNK  # MLA too
    assert EngineConfig(device="cuda", attention="triton", prefill_chunk=1024).prefill_chunk_tokens == 1024
    with pytest.raises(ValueError, match="lone_prefill_chunk .5000. must be a multiple of the prefill chunk .4096."):
        EngineConfig(device="cuda", attention="triton", lone_prefill_chunk=5000)
