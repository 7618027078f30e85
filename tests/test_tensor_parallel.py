"""Tensor parallelism on the CPU (gloo): the sharding plan, a sharded forward against the whole model (dense GQA,
and MLA + MoE), and the verifier service over N ranks (real processes, real gRPC) against N = 1, plus a rank
killed mid-generation."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.local_stack import free_port, wait_healthy
from modeling.checkpoint import load_causal_lm, save_sharded
from modeling.config import ModelConfig
from modeling.target import CausalLM
from modeling.tensor_parallel import TensorParallelCausalLM, even_split, kv_share, load_shard, plan_shards, weight_share
from modeling.tiny import TINY_CONFIGS, make_tiny_target, random_weights
from modeling.tree import DraftTree
from proto import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.engine_helpers import CausalAttention, make_engine, plain_generate, run_to_end
from verifier_service.engine.sampling import SamplingParams
from verifier_service.errors import EngineDown
from verifier_service.metrics import VerifierMetrics
from verifier_service.service import VerifierService

# 8 KV heads, 16 query heads: N = 3 and N = 7 give uneven shards (3/3/2 and 2/1/1/1/1/1/1 KV groups).
WIDE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 100,
        "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 8,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096, "torch_dtype": "float32",
        "eos_token_id": 256}
# Qwen2 (q/k/v bias) with an MLP bias and tied embeddings: every kind of split the loader knows.
BIASED = {**WIDE, "architectures": ["Qwen2ForCausalLM"], "mlp_bias": True, "tie_word_embeddings": True}
MLA_ARCHS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")  # 4 heads, 8 experts (2 per token), 1 shared expert
MAX_NEW = 32


def write_checkpoint(path: Path, raw: dict, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    tensors = random_weights(ModelConfig.from_hf(raw), seed, std=0.05)
    save_sharded(tensors, path, max_shard_bytes=sum(t.numel() * 4 for t in tensors.values()) // 2 + 1)
    return path


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("wide"), WIDE)


@pytest.fixture(scope="module")
def targets(tiny_target, wide_target, tmp_path_factory) -> dict[str, Path]:
    """The dense tiny and wide targets, and each MLA + MoE architecture's tiny checkpoint."""
    mla = {arch: make_tiny_target(tmp_path_factory.mktemp(arch), seed=0, arch=arch) for arch in MLA_ARCHS}
    return {"tiny": tiny_target, "wide": wide_target, **mla}


# ---- the plan ------------------------------------------------------------------------------------------------


def test_even_split_is_contiguous_and_balanced() -> None:
    for total, parts in [(8, 7), (100, 3), (320, 7), (12288, 7), (5, 5)]:
        ranges = even_split(total, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8])
def test_plan_gives_whole_kv_groups_and_covers_everything(world_size: int) -> None:
    config = ModelConfig.from_hf({**WIDE, "num_attention_heads": 32})  # a Qwen3-8B-shaped head layout
    shards = plan_shards(config, world_size)
    assert [s.rank for s in shards] == list(range(world_size))
    kv_counts = [s.kv_heads[1] - s.kv_heads[0] for s in shards]
    assert sum(kv_counts) == 8 and min(kv_counts) >= 1 and max(kv_counts) == -(-8 // world_size)
    for shard in shards:
        assert shard.heads == (shard.kv_heads[0] * 4, shard.kv_heads[1] * 4)  # query heads follow their group
        local = shard.local_config(config)
        assert local.group_size == config.group_size and local.head_dim == config.head_dim
    assert sum(weight_share(config, s) for s in shards) == pytest.approx(1.0)
    if world_size == 7:
        assert kv_counts == [2, 1, 1, 1, 1, 1, 1]


def test_plan_parts_index_the_checkpoint_tensors() -> None:
    config = ModelConfig.from_hf(WIDE)
    shard = plan_shards(config, 7)[0]  # KV heads 0..1, query heads 0..3, head_dim 8
    assert shard.part("model.layers.1.self_attn.q_proj.weight") == (slice(0, 32),)
    assert shard.part("model.layers.1.self_attn.k_proj.bias") == (slice(0, 16),)
    assert shard.part("model.layers.1.self_attn.o_proj.weight") == (slice(None), slice(0, 32))
    assert shard.part("model.layers.0.mlp.down_proj.weight") == (slice(None), slice(0, 15))
    assert shard.part("model.layers.0.mlp.down_proj.bias") is None  # added once, after the all-reduce
    assert shard.part("model.embed_tokens.weight") == (slice(0, 46),)
    assert shard.part("model.layers.0.self_attn.q_norm.weight") is None
    with pytest.raises(ValueError, match="num_kv_heads"):
        plan_shards(config, 9)


def test_plan_splits_mla_heads_and_moe_experts() -> None:
    """DeepSeek-V3's tiny shape over 3 ranks: heads 2/1/1, experts 3/3/2, shared-expert columns 11/11/10;
    the low-rank projections, the router and whole experts are read whole."""
    config = ModelConfig.from_hf(TINY_CONFIGS["deepseek_v3"])  # qk_head_dim 24, nope + v 32, v 16
    shards = plan_shards(config, 3)
    assert [s.heads for s in shards] == [(0, 2), (2, 3), (3, 4)]
    assert [s.experts for s in shards] == [(0, 3), (3, 6), (6, 8)]
    assert [s.shared_experts for s in shards] == [(0, 11), (11, 22), (22, 32)]
    shard = shards[1]
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert shard.part(attn + "q_b_proj.weight") == (slice(48, 72),)
    assert shard.part(attn + "kv_b_proj.weight") == (slice(64, 96),)
    assert shard.part(attn + "o_proj.weight") == (slice(None), slice(32, 48))
    for replicated in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
        assert shard.part(attn + replicated) is None
    assert shard.part(mlp + "gate.weight") is None and shard.part(mlp + "gate.e_score_correction_bias") is None
    assert shard.part(mlp + "experts.4.down_proj.weight") is None
    assert shard.part(mlp + "shared_experts.up_proj.weight") == (slice(11, 22),)
    assert shard.part(mlp + "shared_experts.down_proj.weight") == (slice(None), slice(11, 22))
    assert shard.part("model.layers.0.mlp.gate_proj.weight") == (slice(43, 86),)  # the dense first layer
    v2 = ModelConfig.from_hf(TINY_CONFIGS["deepseek_v2"])  # no q low-rank: q_proj splits by head
    assert plan_shards(v2, 2)[1].part(attn + "q_proj.weight") == (slice(48, 96),)
    assert kv_share(config, shard) == 1.0  # the latent cache is whole on every rank
    with pytest.raises(ValueError, match="num_heads"):
        plan_shards(config, 5)
    with pytest.raises(ValueError, match="n_routed_experts"):
        plan_shards(ModelConfig.from_hf({**TINY_CONFIGS["deepseek_v3"], "n_routed_experts": 2, "n_group": 1}), 3)


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_weight_share_counts_what_a_shard_holds(arch: str) -> None:
    """weight_share (one layer of each kind) against the parameters of whole shards built on the meta device."""
    config = ModelConfig.from_hf(TINY_CONFIGS[arch])

    def params(model: torch.nn.Module) -> int:
        return sum(p.numel() for name, p in model.named_parameters() if not name.endswith("norm.weight"))
    with torch.device("meta"):
        whole = params(CausalLM(config))
        for shard in plan_shards(config, 3):
            assert weight_share(config, shard) == pytest.approx(params(TensorParallelCausalLM(config, shard)) / whole)


# ---- a sharded forward equals the whole one --------------------------------------------------------------------


IDS = torch.arange(37) * 7 % 320


def sharded_forward(rank: int, world_size: int, checkpoints: list[str], store_file: str, out_dir: str) -> None:
    """One rank's forwards (hidden states, drafter features, gathered logits, greedy tokens per checkpoint);
    rank 0 saves them for the test."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    results = []
    for checkpoint in checkpoints:
        model = load_shard(checkpoint, world_size, rank)
        with torch.no_grad():
            hidden, features = model(IDS, torch.arange(len(IDS)), CausalAttention(model.config), capture_layers=(1, 0))
            results.append({"hidden": hidden, "features": features, "logits": model.logits(hidden),
                            "greedy": model.greedy_tokens(hidden)})
    if rank == 0:
        torch.save(results, Path(out_dir) / "rank0.pt")
    dist.barrier()
    # NOTE: leave without gloo's teardown: its destructors race with the peers' and can abort (seen once in CI).
    os._exit(0)


def assert_sharded_equals_whole(checkpoints: list[str], world_size: int, tmp_path: Path) -> None:
    """The ranks are child processes, so a collective library failure can fail the test but never the test
    process."""
    args = (world_size, checkpoints, str(tmp_path / "store"), str(tmp_path))
    torch.multiprocessing.start_processes(sharded_forward, args=args, nprocs=world_size, join=True)
    results = torch.load(tmp_path / "rank0.pt")
    for checkpoint, got in zip(checkpoints, results):
        whole = load_causal_lm(checkpoint)
        with torch.no_grad():
            hidden, features = whole(IDS, torch.arange(len(IDS)), CausalAttention(whole.config),
                                     capture_layers=(1, 0))
        torch.testing.assert_close(got["hidden"], hidden, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got["features"], features, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got["logits"], whole.logits(hidden), atol=1e-5, rtol=1e-4)
        assert torch.equal(got["greedy"], whole.greedy_tokens(hidden))


def test_sharded_forward_equals_the_whole_model(tmp_path) -> None:
    """Over 3 ranks (uneven: 3/3/2 KV groups, 34/33/33 MLP columns, 107/107/106 vocab rows), for a Qwen3 model
    and for a Qwen2 one with q/k/v and MLP biases and tied embeddings."""
    checkpoints = [str(write_checkpoint(tmp_path / name, raw)) for name, raw in (("qwen3", WIDE), ("qwen2", BIASED))]
    assert_sharded_equals_whole(checkpoints, 3, tmp_path)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_mla_moe_forward_equals_the_whole_model(world_size: int, targets, tmp_path) -> None:
    """Each MLA + MoE architecture (4 heads, 8 experts, a dense first layer) over 2 ranks and over 3 (uneven:
    2/1/1 heads, 3/3/2 experts)."""
    assert_sharded_equals_whole([str(targets[arch]) for arch in MLA_ARCHS], world_size, tmp_path)


# ---- the service over N ranks ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ngram_drafter(tmp_path_factory):
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp_path_factory.mktemp("logs") / "drafter.log", "wb")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-m", "drafter_service.server", "--drafter", "ngram",
                                "--listen", address], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(address, 60, process)
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(10)


@contextmanager
def verifier(target: Path, world_size: int, drafter: str, log_dir: Path, *extra_args: str):
    address = f"127.0.0.1:{free_port()}"
    log = open(log_dir / f"verifier-tp{world_size}.log", "wb")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-m", "verifier_service.server", "--target", str(target),
                                "--listen", address, "--drafters", drafter, "--tensor-parallel", str(world_size),
                                "--page-size", "16", "--kv-budget-mb", "4", "--tree-budget", "8", *extra_args],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(address, 90, process)
        with grpc.insecure_channel(address) as channel:
            channel.process = process
            yield channel
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(20)


def generate(stub: verifier_pb2_grpc.VerifierStub, session_id: str, max_new: int = MAX_NEW,
             keep: bool = False) -> tuple[list[int], int]:
    """-> tokens, draft nodes verified."""
    params = common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    tokens, drafted = [], 0
    for step in stub.Generate(verifier_pb2.VerifierGenerateRequest(session_id=session_id, params=params,
                                                                   keep_session=keep), timeout=120):
        tokens += step.token_ids
        drafted += step.drafted_nodes
    return tokens, drafted


def create(stub: verifier_pb2_grpc.VerifierStub, prompt: list[int]) -> str:
    request = verifier_pb2.VerifierCreateSessionRequest(prompt_token_ids=prompt)
    return stub.CreateSession(request, timeout=60).session.session_id


def prompt_of(length: int) -> list[int]:
    rng = random.Random(length)
    return [rng.randrange(256) for _ in range(length)]


# NOTE: 7 gloo ranks on 2 cores make every collective slow (~25 ms): that case runs fewer tokens.
@pytest.mark.parametrize("model, world_size, prompt_lengths, fork", [
    ("tiny", 2, (5, 40), True), ("wide", 3, (17, 33), True), ("wide", 7, (33,), False),
    ("deepseek_v2", 3, (33,), False), ("deepseek_v3", 2, (17,), True), ("glm4_moe_lite", 3, (33,), False)])
def test_greedy_over_n_ranks_equals_one_rank(model, world_size, prompt_lengths, fork, targets, ngram_drafter,
                                             tmp_path) -> None:
    target = targets[model]
    reference = make_engine(target)  # N = 1
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    expected = {n: plain_generate(reference, prompt_of(n), params) for n in prompt_lengths}
    with verifier(target, world_size, ngram_drafter, tmp_path) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        drafted = 0
        for n in prompt_lengths:
            tokens, nodes = generate(stub, create(stub, prompt_of(n)))
            assert tokens == expected[n]
            drafted += nodes
        assert drafted > 0  # tree steps, not only plain decoding
        if fork:  # the parent's and the fork's next writes land in their shared last page: a copy-on-write copy
            n = prompt_lengths[-1]
            parent = create(stub, prompt_of(n))
            first, _ = generate(stub, parent, max_new=3, keep=True)
            child = stub.ForkSession(verifier_pb2.VerifierForkSessionRequest(session_id=parent), timeout=10).session_id
            for session in (parent, child):
                tokens, _ = generate(stub, session, max_new=MAX_NEW - 3)
                assert first + tokens == expected[n]
        info = stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=10)
        assert info.free_pages == info.kv_capacity_pages and info.active_sessions == 0


def test_long_mla_prefill_chunks_over_two_ranks_equal_one_rank(targets, ngram_drafter, tmp_path) -> None:
    """A chunk longer than the latent verify kernel's blocks (what MLA prompts get on CUDA by default) prefills in
    the expanded form, each rank over its own heads; one rank prefilled in 256-token blocks gives the same tokens."""
    target, prompt = targets["deepseek_v3"], prompt_of(400)
    expected = plain_generate(make_engine(target), prompt, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    with verifier(target, 2, ngram_drafter, tmp_path, "--prefill-chunk", "300") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        tokens, _ = generate(stub, create(stub, prompt))
    assert tokens == expected


def test_plain_decoding_in_bursts_over_two_ranks_equals_one_rank(targets, tmp_path) -> None:
    """No drafter: every step after the first is a burst (the verifier's default 4 steps per call), whose later
    steps take their tokens from the last greedy head on every rank."""
    expected = plain_generate(make_engine(targets["tiny"]), prompt_of(21),
                              SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    with verifier(targets["tiny"], 2, "", tmp_path) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        params = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
        request = verifier_pb2.VerifierGenerateRequest(session_id=create(stub, prompt_of(21)), params=params)
        steps = [list(step.token_ids) for step in stub.Generate(request, timeout=120) if not step.HasField("prefill")]
    assert [token for step in steps for token in step] == expected
    assert max(len(step) for step in steps) == 4


@pytest.mark.parametrize("drafted", [True, False], ids=["tree-steps", "bursts"])
def test_logprobs_over_two_ranks_equal_one_rank(drafted: bool, targets, ngram_drafter, tmp_path) -> None:
    """The vocab is sharded: a greedy step's logprobs gather the asking rows' logits from every rank (Logits)."""
    reference = make_engine(targets["tiny"])
    session, _ = reference.create_session(prompt_of(21))
    reference.start_generation(session.session_id, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=4))
    tokens, results = run_to_end(reference, session.session_id, lambda _: DraftTree.empty())
    expected = [lp for r in results for lp in r.logprobs]
    with verifier(targets["tiny"], 2, ngram_drafter if drafted else "", tmp_path) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        params = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=4)
        request = verifier_pb2.VerifierGenerateRequest(session_id=create(stub, prompt_of(21)), params=params)
        steps = [step for step in stub.Generate(request, timeout=120) if not step.HasField("prefill")]
    assert [t for step in steps for t in step.token_ids] == tokens
    assert (max(step.acceptance_length for step in steps) > 1) if drafted else max(len(s.token_ids) for s in steps) > 1
    got = [lp for step in steps for lp in step.logprobs]
    assert [list(lp.top_token_ids) for lp in got] == [list(lp.top_ids) for lp in expected]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
    assert [v for lp in got for v in lp.top_logprobs] == pytest.approx(
        [v for lp in expected for v in lp.top_logprobs], abs=1e-5)


def test_prompt_logprobs_over_two_ranks_equal_one_rank(targets, tmp_path) -> None:
    """A prefill's logits slices go through the Logits command too: every rank joins each slice's gather. A prompt of
    two prefill chunks in slices of 50 rows (CreateSession), then a turn appended to it (Generate)."""
    prompt, turn = prompt_of(300), prompt_of(40)
    reference = make_engine(targets["tiny"])
    created = reference.begin_session(prompt, "reference", prompt_logprobs=3)
    created.run(lambda: False, lambda done, total: None)
    appended = reference.begin_extend("reference", turn, prompt_logprobs=3)
    appended.run(lambda: False, lambda done, total: None)
    with verifier(targets["tiny"], 2, "", tmp_path, "--prompt-logprob-rows", "50") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        reply = stub.CreateSession(verifier_pb2.VerifierCreateSessionRequest(prompt_token_ids=prompt,
                                                                             prompt_logprobs=3), timeout=120)
        request = verifier_pb2.VerifierGenerateRequest(
            session_id=reply.session.session_id, append_token_ids=turn, prompt_logprobs=3,
            params=common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True))
        (scored,) = [step.prompt_logprobs for step in stub.Generate(request, timeout=120) if step.prompt_logprobs]
    for got, expected in ((reply.prompt_logprobs, created.logprobs), (scored, appended.logprobs)):
        assert len(got) == len(expected)
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
        assert [list(lp.top_token_ids) for lp in got] == [list(lp.top_ids) for lp in expected]
        assert [lp.rank for lp in got] == [lp.rank for lp in expected]


@pytest.mark.parametrize("drafted", [True, False], ids=["tree-steps", "single-steps"])
def test_penalties_over_two_ranks_equal_one_rank(drafted: bool, targets, ngram_drafter, tmp_path) -> None:
    """Penalized rows take the full logits, gathered on every rank (Head, not greedy); rank 0 adjusts them and
    chooses. Without a drafter they go one step per call: a token chosen on rank 0 alone cannot feed a burst."""
    adjustments = dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=-0.5)  # NOTE: loops: drafts hit
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logit_bias=((7, 2.0),), **adjustments)
    expected = plain_generate(make_engine(targets["tiny"]), prompt_of(21), params)
    assert expected != plain_generate(make_engine(targets["tiny"]), prompt_of(21), SamplingParams(
        max_new_tokens=MAX_NEW, ignore_eos=True))
    with verifier(targets["tiny"], 2, ngram_drafter if drafted else "", tmp_path) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        pb = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logit_bias={7: 2.0}, **adjustments)
        request = verifier_pb2.VerifierGenerateRequest(session_id=create(stub, prompt_of(21)), params=pb)
        steps = [step for step in stub.Generate(request, timeout=120) if not step.HasField("prefill")]
        assert [t for step in steps for t in step.token_ids] == expected
        if drafted:
            assert max(step.acceptance_length for step in steps) > 1
        else:
            assert {len(step.token_ids) for step in steps} == {1}
        pb.logit_bias[999999] = 1.0
        request = verifier_pb2.VerifierGenerateRequest(session_id=create(stub, prompt_of(21)), params=pb)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=60))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "logit_bias: token 999999 is outside the vocabulary (0..319)" in caught.value.details()


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def follower_pids(verifier_pid: int) -> list[int]:
    """The followers are the children of the verifier's multiprocessing fork server."""
    (server,) = [c for c in children(verifier_pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return children(server)


def test_a_rank_killed_mid_generation_makes_the_service_unavailable(tiny_target, ngram_drafter, tmp_path) -> None:
    with verifier(tiny_target, 2, ngram_drafter, tmp_path) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        (follower,) = follower_pids(channel.process.pid)
        params = common_pb2.SamplingParams(max_new_tokens=4000, ignore_eos=True)
        steps = stub.Generate(verifier_pb2.VerifierGenerateRequest(session_id=create(stub, prompt_of(40)),
                                                                   params=params), timeout=60)
        next(steps)
        killed = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as error:
            for _ in steps:
                pass
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value.details()
        assert time.monotonic() - killed < 10
        while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != \
                health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - killed < 10
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as error:
            create(stub, [1, 2, 3])
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert channel.process.poll() is None  # still up, reporting NOT_SERVING


def test_a_stuck_engine_thread_holds_no_request_once_the_engine_is_down(tiny_target) -> None:
    """With NCCL, rank 0 can sit in a collective with a dead peer until the timeout: the watchdog's `fail`
    must not wait for it."""
    engine = make_engine(tiny_target)
    collective = threading.Event()
    engine.step = lambda work: collective.wait()  # a step that never returns by itself

    async def scenario() -> None:
        service = VerifierService(engine, None, VerifierMetrics(), inline_steps=False)  # as a TP group serves
        await service.start()
        session = await service.create_session([1, 2, 3])
        steps = service.generate(session.session_id, [], SamplingParams(max_new_tokens=4), keep_session=False)
        first = asyncio.ensure_future(anext(steps))
        await asyncio.sleep(0.2)
        assert not first.done()
        service.fail("rank 1 exited")
        with pytest.raises(EngineDown, match="rank 1 exited"):
            await asyncio.wait_for(first, 1.0)
        with pytest.raises(EngineDown):
            await service.create_session([4, 5])
        collective.set()
        await service.stop()
    asyncio.run(scenario())
