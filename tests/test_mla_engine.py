"""MLA + MoE targets through the engine: the paged latent cache, absorbed-form verification (the torch
reference, prefix and tree merged by LSE) and speculative decoding, exact against plain greedy decoding,
offline and through the gRPC services, for each architecture's tiny checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ddtree.cli import TINY_ARCHS
from ddtree.client import Client
from ddtree.local_stack import LocalStack, free_port
from ddtree.offline import generate_offline
from ddtree_kernels.reference import latent_verify_attention_reference, pack_tree_mask
from drafter_service.server import load_drafter
from modeling.checkpoint import load_causal_lm
from modeling.config import ModelConfig
from modeling.tiny import TINY_CONFIGS, make_tiny_drafter, make_tiny_target
from modeling.tree import DraftTree
from tests.engine_helpers import CausalAttention, burst_to_end, emitted_of, make_engine, plain_generate, run_to_end
from verifier_service.engine.config import resolve_attention
from verifier_service.engine.kv_cache import KVCache
from verifier_service.engine.sampling import SamplingParams

ARCHS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)
REPETITIVE = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."


@pytest.fixture(scope="module", params=ARCHS)
def mla_target(request, tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp(request.param), seed=0, arch=request.param)


@pytest.fixture(scope="module")
def mla_dflash(mla_target, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("dflash"), mla_target, seed=1)


def test_the_latent_reference_is_one_softmax_over_prefix_and_tree() -> None:
    """The prefix and tree partials merged by LSE equal one masked softmax over both, per head."""
    gen = torch.Generator().manual_seed(0)
    heads, dim, value_dim, page_size = 3, 12, 8, 4
    lens, trees = [0, 5, 11], [3, 1, 4]
    pages = torch.randn(8, page_size, 1, dim, generator=gen)
    tables = torch.tensor([[0, 0, 0], [3, 1, 0], [2, 5, 7]], dtype=torch.int32)
    q = torch.randn(sum(trees), heads, dim, generator=gen)
    tree_entries = torch.randn(sum(trees), dim, generator=gen)
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    masks = [torch.ones(t, t, dtype=torch.bool).tril() for t in trees]
    masks[2][3, 1] = False  # a branch: row 3 does not see row 1
    words = torch.cat([pack_tree_mask(m) for m in masks])
    got = latent_verify_attention_reference(q, pages, tables, torch.tensor(lens, dtype=torch.int32),
                                            tree_entries, cu, words, 0.3, value_dim)
    for b, (n, t) in enumerate(zip(lens, trees)):
        lo = int(cu[b])
        prefix = pages[tables[b].long()].flatten(0, 2)[:n]
        keys = torch.cat([prefix, tree_entries[lo:lo + t]])
        visible = torch.cat([torch.ones(t, n, dtype=torch.bool), masks[b]], dim=1)
        scores = torch.einsum("thc,sc->hts", q[lo:lo + t], keys) * 0.3
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        torch.testing.assert_close(got[lo:lo + t], torch.einsum("hts,sv->thv", probs, keys[:, :value_dim]))


def test_the_cache_holds_one_latent_entry_per_token_and_layer(mla_target) -> None:
    engine = make_engine(mla_target)
    mla = engine.model_config.mla
    assert engine.kv.v is None and engine.kv.k.shape[-2:] == (1, mla.latent_dim)
    assert KVCache.page_bytes(engine.model_config, 16, torch.float32) == 4 * 16 * mla.latent_dim * 4


def test_plain_decoding_equals_the_model_run_causally(mla_target) -> None:
    """Paged latent prefix + chunked prefill + one token per step == the whole sequence recomputed each time."""
    engine = make_engine(mla_target)
    model = load_causal_lm(mla_target)
    prompt = engine.tokenizer.encode("latent attention, paged")
    got = plain_generate(engine, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            hidden, _ = model(torch.tensor(ids), torch.arange(len(ids)), CausalAttention(model.config))
            ids.append(int(model.logits(hidden[-1:]).argmax()))
    assert got == ids[len(prompt):]
    assert decoded_in_bursts(engine, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)) == got


def decoded_in_bursts(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The first step alone, then plain steps in bursts of 5 (Engine.decode), as the step loop runs them."""
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, params)
    (first,) = engine.step([(session.session_id, DraftTree.empty())])
    tokens = first.emitted + emitted_of(burst_to_end(engine, [session.session_id], 5)[session.session_id])
    engine.release_session(session.session_id)
    return tokens


@pytest.mark.parametrize("page_size", [16, 64])
def test_dflash_and_ngram_greedy_equal_plain(mla_target, mla_dflash, page_size: int) -> None:
    engine = make_engine(mla_target, page_size=page_size)
    prompt = engine.tokenizer.encode(REPETITIVE)
    plain = generate_offline(engine, None, prompt, PARAMS)
    for drafter in (load_drafter(str(mla_dflash), str(mla_target)), load_drafter(str(mla_dflash), str(mla_target),
                                                                                   context_window=8),
                    load_drafter("ngram", None)):
        result = generate_offline(engine, drafter, prompt, PARAMS, tree_budget=15)
        assert result.token_ids == plain.token_ids
    assert max(result.acceptance_lengths) > 1  # the n-gram drafter accepts on repetitive text
    assert engine.pool.num_free == engine.pool.num_pages


def test_forks_share_the_latent_pages_and_stay_independent(mla_target) -> None:
    engine = make_engine(mla_target)
    prompt = engine.tokenizer.encode("a shared prefix of latent pages, then two continuations")
    expected = plain_generate(engine, prompt, PARAMS)
    parent, _ = engine.create_session(prompt)
    fork = engine.fork_session(parent.session_id)
    assert fork.block_table.pages == parent.block_table.pages
    for session in (fork, parent):  # the fork writes first: copy-on-write must leave the parent's pages alone
        engine.start_generation(session.session_id, PARAMS)
        emitted, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
        assert emitted == expected
    for session in (fork, parent):
        engine.release_session(session.session_id)
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("drafter", ["dflash", "ngram"])
def test_greedy_through_the_services_equals_offline(mla_target, mla_dflash, tmp_path, drafter: str) -> None:
    engine = make_engine(mla_target, page_size=64)
    expected = generate_offline(engine, None, engine.tokenizer.encode(REPETITIVE),
                                SamplingParams(max_new_tokens=24)).token_ids
    drafter = str(mla_dflash) if drafter == "dflash" else drafter
    with LocalStack(str(mla_target), drafter, drafters=1, gateway_listen=f"127.0.0.1:{free_port()}",
                    verifier_args=("--page-size", "16", "--max-context", "2048", "--tree-budget", "8"),
                    log_dir=tmp_path) as stack:
        generation = Client(stack.addresses["gateway"], timeout=120).generate(REPETITIVE, max_new_tokens=24)
        list(generation)
    assert generation.token_ids == expected


def test_make_tiny_model_writes_each_architecture(tmp_path) -> None:
    """`ddtree make-tiny-model --arch` (whose choices are spelled out so parsing needs no torch) writes a target
    of that family and a drafter that loads against it."""
    assert set(TINY_ARCHS) == set(TINY_CONFIGS)
    subprocess.run([sys.executable, "-m", "ddtree.cli", "make-tiny-model", str(tmp_path), "--arch", "glm4_moe_lite"],
                   check=True, capture_output=True)
    assert ModelConfig.from_dir(tmp_path / "target").architecture == "Glm4MoeLiteForCausalLM"
    drafter = load_drafter(str(tmp_path / "dflash"), str(tmp_path / "target"))
    assert drafter.info.kind == "dflash"


@pytest.mark.parametrize("raw", [{"architectures": ["DeepseekV32ForCausalLM"]},
                                 {"architectures": ["GlmMoeDsaForCausalLM"]},
                                 {"architectures": ["DeepseekV3ForCausalLM"], "index_topk": 2048}])
def test_sparse_attention_models_are_refused_by_name(raw) -> None:
    with pytest.raises(ValueError, match="DeepSeek Sparse Attention"):
        ModelConfig.from_hf(raw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter case runs on CPU machines")
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")  # the tiles' padding rows
def test_the_triton_backend_equals_the_torch_backend_interpreter(mla_target) -> None:
    """The MLA verify kernel and the latent commit (Triton's CPU interpreter) in the engine: speculative greedy
    equals the torch backend's plain greedy."""
    prompt = make_engine(mla_target).tokenizer.encode(REPETITIVE)
    plain = generate_offline(make_engine(mla_target), None, prompt, PARAMS)
    engine = make_engine(mla_target, attention="triton")
    result = generate_offline(engine, load_drafter("ngram", None), prompt, PARAMS, tree_budget=15)
    assert result.token_ids == plain.token_ids
    assert max(result.acceptance_lengths) > 1 and engine.pool.num_free == engine.pool.num_pages


def test_a_second_turn_equals_one_generation_over_the_concatenation(mla_target) -> None:
    engine = make_engine(mla_target)
    first, second = engine.tokenizer.encode("first turn. "), engine.tokenizer.encode("second turn?")
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    session, _ = engine.create_session(first)
    engine.start_generation(session.session_id, params)
    reply, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
    engine.extend_session(session.session_id, second)
    engine.start_generation(session.session_id, params)
    continued, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
    engine.release_session(session.session_id)
    assert continued == plain_generate(engine, first + reply + second, params)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_on_the_gpu_with_the_kernels(mla_target, mla_dflash, dtype: str, cuda_graphs: bool) -> None:
    """The MLA verify kernel, the fused MoE and the latent commit, captured in CUDA graphs or eager: exact in fp32;
    in bf16 the tree and the plain path may round differently, so there it must agree for a while."""
    engine = make_engine(mla_target, device="cuda", dtype=dtype, attention="triton", cuda_graphs=cuda_graphs)
    prompt = engine.tokenizer.encode(REPETITIVE)
    plain = generate_offline(engine, None, prompt, PARAMS)
    for drafter in (load_drafter(str(mla_dflash), str(mla_target), device="cuda", dtype=dtype),
                    load_drafter("ngram", None)):
        result = generate_offline(engine, drafter, prompt, PARAMS, tree_budget=15)
        diverged = next((i for i, (a, b) in enumerate(zip(result.token_ids, plain.token_ids)) if a != b), None)
        assert diverged is None if dtype == "float32" else diverged is None or diverged >= 8
    if dtype == "float32":  # decode bursts feed their tokens on the device, graphed or eager
        assert decoded_in_bursts(engine, prompt, PARAMS) == plain.token_ids
    assert engine.pool.num_free == engine.pool.num_pages
    if dtype == "float32":  # the kernels against the torch backend on the same GPU
        reference = make_engine(mla_target, device="cuda", dtype=dtype, attention="torch")
        assert generate_offline(reference, None, prompt, PARAMS).token_ids == plain.token_ids


def test_auto_attention_picks_the_kernels_on_cuda() -> None:
    assert resolve_attention("auto", "cuda") == "triton"
    assert resolve_attention("auto", "cuda:1") == "triton"
    assert resolve_attention("auto", "cpu") == "torch"
    assert resolve_attention("triton", "cpu") == "triton"  # an explicit choice stands
