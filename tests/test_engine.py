"""Exactness of the verify/commit engine against plain greedy decoding, KV integrity, errors."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_kernels.reference import gather_prefix
from modeling.graph_capture import buckets
from modeling.tree import DraftTree, TreeError
from tests.engine_helpers import (
    GREEDY,
    burst_to_end,
    emitted_of,
    make_engine,
    plain_generate,
    random_tree,
    run_to_end,
)
from verifier_service.engine.cuda_graphs import Buckets, spread
from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.stopping import StopReason
from verifier_service.engine.verify_batch import BlockSpec, build_verify_batch
from verifier_service.errors import CapacityError, InvalidArgument, PrefillStopped

BACKENDS = [pytest.param({}, id="torch-cpu"),
            pytest.param({"device": "cuda", "attention": "triton"}, id="triton-cuda-graphs", marks=pytest.mark.gpu),
            pytest.param({"device": "cuda", "attention": "triton", "cuda_graphs": False}, id="triton-cuda-eager",
                         marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def new_engine(request, tiny_target):
    """Engines on the reference backend, and (GPU machines) on the Triton kernels."""
    def factory(**overrides):
        return make_engine(tiny_target, **request.param, **overrides)
    # NOTE: on the GPU the kernels accumulate in a different order than a fresh prefill: looser KV bound.
    factory.kv_atol = 1e-3 if request.param else 1e-5
    return factory


def prompt_of(length: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.mark.parametrize("page_size", [16, 64])
def test_speculative_greedy_equals_plain_greedy(new_engine, page_size: int) -> None:
    engine = new_engine(page_size=page_size, max_tree_nodes=128)
    rng = random.Random(page_size)
    steps = 0
    # prompts ending one before, at, and one after page boundaries, and spanning several pages
    for length in (1, page_size - 1, page_size, page_size + 1, 2 * page_size + 3):
        prompt = prompt_of(length, seed=length)
        params = SamplingParams(max_new_tokens=70, ignore_eos=True)
        expected = plain_generate(engine, prompt, params)
        session, _ = engine.create_session(prompt)
        engine.start_generation(session.session_id, params)

        def next_tree(emitted: list[int], expected: list[int] = expected) -> DraftTree:
            budget = rng.choice([1, 2, 5, 16, 40, 128])
            return random_tree(rng, budget, 320, expected[len(emitted):], rng.choice(["chain", "wide", "random"]))

        got, results = run_to_end(engine, session.session_id, next_tree)
        steps += len(results)
        assert got == expected
        assert any(r.acceptance_length > 1 for r in results)  # the planted paths were accepted
        engine.release_session(session.session_id)
    assert steps >= 100
    assert engine.pool.num_free == engine.pool.num_pages  # nothing leaked


def kv_of(engine, session) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.tensor(session.block_table.pages)
    return (torch.stack([gather_prefix(engine.kv.k[i], table, session.kv_len) for i in range(engine.kv.k.shape[0])]),
            torch.stack([gather_prefix(engine.kv.v[i], table, session.kv_len) for i in range(engine.kv.v.shape[0])]))


def test_pages_after_many_steps_equal_a_fresh_prefill(new_engine) -> None:
    engine = new_engine(max_tree_nodes=64)
    rng = random.Random(3)
    prompt = prompt_of(21)
    expected = plain_generate(engine, prompt, SamplingParams(max_new_tokens=80, ignore_eos=True))
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, SamplingParams(max_new_tokens=80, ignore_eos=True))
    run_to_end(engine, session.session_id,
               lambda out: random_tree(rng, rng.randrange(1, 64), 320, expected[len(out):], "random"))
    fresh, _ = engine.create_session(list(session.tokens))
    assert fresh.kv_len == session.kv_len == len(prompt) + 80 - 1
    for stepped, prefilled in zip(kv_of(engine, session), kv_of(engine, fresh)):
        torch.testing.assert_close(stepped, prefilled, atol=new_engine.kv_atol, rtol=1e-3)


BAD_TREES = {
    "parent not earlier": (DraftTree((5, 6), (-1, 1), (1, 2)), "parents\\[1\\]"),
    "negative token": (DraftTree((5, -2), (-1, 0), (1, 2)), "tokens\\[1\\]"),
    "token past vocab": (DraftTree((320,), (-1,), (1,)), "tokens\\[0\\]"),
    "too many nodes": (DraftTree.chain(list(range(9))), "more than the maximum 8"),
    "depth inconsistent": (DraftTree((5, 6), (-1, 0), (1, 3)), "depths\\[1\\]"),
    "length mismatch": (DraftTree((5, 6), (-1,), (1, 2)), "parents"),
}


@pytest.mark.parametrize("case", sorted(BAD_TREES))
def test_bad_tree_is_rejected_and_session_survives(new_engine, case: str) -> None:
    engine = new_engine(max_tree_nodes=8)
    prompt = prompt_of(19)
    expected = plain_generate(engine, prompt)
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, GREEDY)
    engine.step([(session.session_id, DraftTree.empty())])
    before = (list(session.tokens), list(session.block_table.pages), kv_of(engine, session), engine.pool.num_free)
    tree, message = BAD_TREES[case]
    with pytest.raises(TreeError, match=message):
        engine.step([(session.session_id, tree)])
    after = (session.tokens, session.block_table.pages, kv_of(engine, session), engine.pool.num_free)
    assert before[0] == after[0] and before[1] == after[1] and before[3] == after[3]
    assert all(torch.equal(a, b) for a, b in zip(before[2], after[2]))
    got, _ = run_to_end(engine, session.session_id, lambda out: DraftTree.chain(expected[1 + len(out):][:4]))
    assert expected[:1] + got == expected


def test_prompt_over_capacity_is_refused_without_leaks(new_engine) -> None:
    engine = new_engine(kv_budget_bytes=8 * 16 * 2 * 4 * 2 * 16 * 4)  # 8 pages of 16 tokens
    assert engine.pool.num_pages == 8
    other, _ = engine.create_session(prompt_of(40))  # 3 pages
    free = engine.pool.num_free
    with pytest.raises(CapacityError, match="KV cache full"):
        engine.create_session(prompt_of(100, seed=2))  # 7 pages > 5 free (no prefix in common)
    assert engine.pool.num_free == free and len(engine.sessions) == 1
    with pytest.raises(CapacityError):
        engine.extend_session(other.session_id, prompt_of(90))
    assert other.kv_len == 39 and engine.pool.num_free == free
    expected = plain_generate(new_engine(), prompt_of(40))
    engine.start_generation(other.session_id, GREEDY)
    got, _ = run_to_end(engine, other.session_id, lambda _: DraftTree.empty())
    assert got == expected


def test_prompt_errors_name_the_field(new_engine) -> None:
    engine = new_engine(max_context=64)
    with pytest.raises(InvalidArgument, match="prompt"):
        engine.create_session([])
    with pytest.raises(InvalidArgument, match="max_context"):
        engine.create_session(prompt_of(65))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        engine.create_session([1, 2, 999])
    for bad, field in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(top_k=-3), "top_k"), (dict(max_new_tokens=0), "max_new_tokens")]:
        session, _ = engine.create_session([1, 2, 3])
        with pytest.raises(InvalidArgument, match=field):
            engine.start_generation(session.session_id, SamplingParams(**bad))


def test_a_stopped_or_failed_prefill_gives_every_page_back(new_engine) -> None:
    """A prefill stops between chunks once its caller is gone (or fails in a forward): a new session leaves
    nothing allocated, an extended one is left exactly as it was and still generates the same tokens."""
    engine = new_engine()
    free = engine.pool.num_free
    chunks = iter([False, False, True])
    with pytest.raises(PrefillStopped):
        engine.create_session(prompt_of(100), should_stop=lambda: next(chunks))  # stops at the third chunk
    assert engine.pool.num_free == free and not engine.sessions
    session, _ = engine.create_session(prompt_of(40))
    held, tokens = list(session.block_table.pages), list(session.tokens)
    chunks = iter([False, True])
    with pytest.raises(PrefillStopped):
        engine.extend_session(session.session_id, prompt_of(60, seed=2), should_stop=lambda: next(chunks))
    assert session.block_table.pages == held and session.tokens == tokens
    forward, calls = engine.forward, []

    def failing_forward(blocks):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a forward failed")
        return forward(blocks)
    engine.forward = failing_forward
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.extend_session(session.session_id, prompt_of(60, seed=2))
    engine.forward = forward
    assert session.block_table.pages == held and session.tokens == tokens
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.start_generation(session.session_id, params)
    got, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
    engine.release_session(session.session_id)
    assert got == plain_generate(engine, tokens, params) and engine.pool.num_free == free


def test_generation_stops_at_max_context(new_engine) -> None:
    engine = new_engine(max_context=50)
    session, _ = engine.create_session(prompt_of(45))
    engine.start_generation(session.session_id, SamplingParams(max_new_tokens=100, ignore_eos=True))
    got, results = run_to_end(engine, session.session_id, lambda _: DraftTree.chain([1] * 30))
    assert len(session.tokens) == 50 and len(got) == 5 and results[-1].finished == StopReason.CONTEXT_LIMIT


def test_a_path_in_a_tree_cut_to_the_context_names_the_nodes_as_drafted(new_engine) -> None:
    """Near the context's end the engine verifies the tree cut to the room left, which re-indexes its nodes; the
    path it reports (what the budget policy learns from) still names them as the drafter numbered them."""
    engine = new_engine(max_context=50)
    prompt = prompt_of(45)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    first, second = plain_generate(engine, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))[:2]
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, params)
    (result,) = engine.step([(session.session_id, DraftTree.empty())])  # the first step emits `first`
    wrong = (second + 1) % engine.model_config.vocab_size
    # nodes 0-5: a chain of six wrong tokens, deeper than the room left; node 6: the right token at depth 1
    tree = DraftTree((wrong,) * 6 + (second,), (-1, 0, 1, 2, 3, 4, -1), (1, 2, 3, 4, 5, 6, 1))
    (result,) = engine.step([(session.session_id, tree)])
    assert result.accepted == [second] and result.path == [6]
    engine.release_session(session.session_id)


def test_stop_token_and_stop_string_cut_the_output(new_engine) -> None:
    engine = new_engine()
    prompt = prompt_of(30)
    reference = plain_generate(engine, prompt)
    stop_token = reference[7]
    first = reference.index(stop_token)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(stop_token,))
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, params)
    got, results = run_to_end(engine, session.session_id, lambda out: DraftTree.chain(reference[len(out):][:10]))
    assert got == reference[: first + 1] and results[-1].finished == StopReason.STOP_TOKEN
    assert session.tokens == prompt + got and session.kv_len == len(prompt) + len(got) - 1

    text = engine.tokenizer.decode(reference)
    stop = text[10:12]
    params = SamplingParams(max_new_tokens=40, stop_strings=(stop,))
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, params)
    got, results = run_to_end(engine, session.session_id, lambda out: DraftTree.chain(reference[len(out):][:10]))
    assert results[-1].finished == StopReason.STOP_STRING
    assert stop in engine.tokenizer.decode(got) and stop not in engine.tokenizer.decode(got[:-1])
    assert got == reference[: len(got)]


def test_batched_step_equals_separate_sessions(new_engine) -> None:
    engine = new_engine()
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 33)]
    expected = [plain_generate(engine, p) for p in prompts]
    rng = random.Random(5)
    sessions = [engine.create_session(p)[0].session_id for p in prompts]
    outputs: dict[str, list[int]] = {sid: [] for sid in sessions}
    for sid in sessions:
        engine.start_generation(sid, GREEDY)
    live = list(sessions)
    while live:
        work = [(sid, random_tree(rng, 12, 320, expected[sessions.index(sid)][len(outputs[sid]):], "random"))
                for sid in live]
        for result in engine.step(work):
            outputs[result.session_id] += result.emitted
            if result.finished:
                live.remove(result.session_id)
    assert [outputs[s] for s in sessions] == expected


def test_fork_shares_pages_and_both_branches_continue_exactly(new_engine) -> None:
    engine = new_engine()
    prompt = prompt_of(40)
    base, _ = engine.create_session(prompt)
    used = engine.pool.num_pages - engine.pool.num_free
    fork = engine.fork_session(base.session_id)
    assert engine.pool.num_pages - engine.pool.num_free == used  # nothing copied yet
    turn_a, turn_b = [65, 66, 67], [120, 121]
    engine.extend_session(base.session_id, turn_a)
    engine.extend_session(fork.session_id, turn_b)
    for session, turn in ((base, turn_a), (fork, turn_b)):
        engine.start_generation(session.session_id, GREEDY)
        got, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
        assert got == plain_generate(engine, prompt + turn)
    engine.release_session(base.session_id)
    engine.release_session(fork.session_id)
    assert engine.pool.num_free == engine.pool.num_pages


def test_multi_turn_equals_one_prompt(new_engine) -> None:
    engine = new_engine()
    session, _ = engine.create_session(prompt_of(10))
    history = list(session.tokens)
    for turn in ([40, 41, 42], [50] * 20):
        engine.start_generation(session.session_id, SamplingParams(max_new_tokens=7, ignore_eos=True))
        got, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
        history += got
        engine.extend_session(session.session_id, turn)
        history += turn
    engine.start_generation(session.session_id, GREEDY)
    got, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
    assert got == plain_generate(engine, history)


def test_step_returns_features_of_committed_tokens(new_engine) -> None:
    engine = new_engine(feature_layers=(1, 2))
    prompt = prompt_of(30)
    _, seed = engine.create_session(prompt, session_id="a", feature_tail=8)
    assert seed.shape == (8, 2 * 64)
    engine.start_generation("a", GREEDY)
    expected = plain_generate(engine, prompt)
    (result,) = engine.step([("a", DraftTree.chain(expected[:3]))])
    assert result.committed == [prompt[-1], *expected[:3]] and result.features.shape == (4, 128)
    _, whole = engine.create_session(prompt + expected[:4], feature_tail=4)
    torch.testing.assert_close(result.features, whole, atol=new_engine.kv_atol, rtol=1e-3)


def test_decode_bursts_equal_single_steps_and_stop_where_they_do(new_engine) -> None:
    """Sessions of different lengths and stops decoded several steps per call: every session's tokens are those
    of single plain steps, each stops where it would (a stop token, max_new_tokens, the context, each mid-burst),
    and the pages hold exactly what a fresh prefill of the tokens would."""
    engine = new_engine(max_context=120)
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 33, 100)]
    reference = plain_generate(engine, prompts[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
    params = [SamplingParams(max_new_tokens=40, stop_token_ids=(reference[11],)),
              SamplingParams(max_new_tokens=23, ignore_eos=True),
              SamplingParams(max_new_tokens=40, ignore_eos=True),
              SamplingParams(max_new_tokens=40, ignore_eos=True)]  # the context ends it after 20 tokens
    expected = [plain_generate(engine, p, q) for p, q in zip(prompts, params)]
    assert len(expected[0]) == reference.index(reference[11]) + 1 and len(expected[3]) == 20
    sessions = [engine.create_session(p)[0] for p in prompts]
    for session, q in zip(sessions, params):
        engine.start_generation(session.session_id, q)
    first = engine.step([(s.session_id, DraftTree.empty()) for s in sessions])  # as the loop: the first step alone
    results = burst_to_end(engine, [s.session_id for s in sessions], steps=6)
    for session, result, want in zip(sessions, first, expected):
        got = results[session.session_id]
        assert result.emitted + emitted_of(got) == want
        assert all(len(r.emitted) <= 6 and r.accepted == [] for r in got)
        fresh, _ = engine.create_session(list(session.tokens))
        for decoded, prefilled in zip(kv_of(engine, session), kv_of(engine, fresh)):
            torch.testing.assert_close(decoded, prefilled, atol=new_engine.kv_atol, rtol=1e-3)
        engine.release_session(fresh.session_id)
    assert max(len(r.emitted) for r in results[sessions[2].session_id]) == 6  # bursts did run
    assert [r[-1].finished for r in results.values()] == [StopReason.STOP_TOKEN, StopReason.LENGTH,
                                                          StopReason.LENGTH, StopReason.CONTEXT_LIMIT]
    for session in sessions:
        engine.release_session(session.session_id)
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_sampled_burst_draws_as_single_steps_do(new_engine) -> None:
    engine = new_engine()
    params = SamplingParams(temperature=0.9, top_k=50, seed=7, max_new_tokens=30, ignore_eos=True)
    expected = plain_generate(engine, prompt_of(12), params)
    session, _ = engine.create_session(prompt_of(12))
    engine.start_generation(session.session_id, params)
    (first,) = engine.step([(session.session_id, DraftTree.empty())])
    got = burst_to_end(engine, [session.session_id], steps=4)[session.session_id]
    assert first.emitted + emitted_of(got) == expected


def test_a_burst_returns_the_features_of_its_committed_tokens(new_engine) -> None:
    engine = new_engine(feature_layers=(1, 2))
    prompt = prompt_of(30)
    engine.create_session(prompt, session_id="a")
    engine.start_generation("a", GREEDY)
    (result,) = engine.decode(["a"], 5)
    assert result.committed == [prompt[-1], *result.emitted[:4]] and result.commit_start == 29
    _, whole = engine.create_session(prompt + result.emitted, feature_tail=5)  # its KV holds the committed
    torch.testing.assert_close(result.features, whole, atol=new_engine.kv_atol, rtol=1e-3)


def test_burst_length_and_refusals(new_engine) -> None:
    engine = new_engine(max_context=40, kv_budget_bytes=1 << 20)
    engine.create_session(prompt_of(30), session_id="a")
    engine.create_session(prompt_of(10), session_id="b")
    engine.start_generation("a", SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert engine.burst_length(["a", "b"], 8) == 1  # b has no generation
    engine.start_generation("b", SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert engine.burst_length(["a"], 8) == 3  # a's last token
    assert engine.burst_length(["a", "b"], 8) == 8  # b would use them
    assert engine.burst_length(["a", "b"], 20) == 10  # a's context room
    with pytest.raises(InvalidArgument, match="does not fit"):
        engine.decode(["a", "b"], 11)
    with pytest.raises(InvalidArgument, match="twice"):
        engine.decode(["a", "a"], 2)
    before = [list(engine.session(s).tokens) for s in ("a", "b")]
    assert [r.emitted for r in engine.decode(["a", "b"], 10)][0] == engine.session("a").tokens[30:]
    assert len(engine.session("a").tokens) == 33 and len(engine.session("b").tokens) == 20
    assert before[1] == engine.session("b").tokens[:10]


def test_bucket_sizes() -> None:
    assert buckets(1) == [1] and buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert buckets(2048, 16) == [16, 32, 64, 128, 256, 512, 1024, 2048] and buckets(8, 16) == [8]


@pytest.mark.parametrize("max_seqs, max_tokens, per_session", [(64, 2048, 16), (48, 2048, 64), (8, 300, 33)])
def test_warm_up_reaches_the_bucket_of_every_step_and_prefill_chunk(max_seqs, max_tokens, per_session) -> None:
    """No batch a server can form (up to max_seqs sessions of 1..per_session rows, or one prefill chunk of up
    to 256 rows) lands in a bucket that warm-up skipped, and warm-up captures none that such batches miss."""
    table = Buckets.up_to(max_seqs, max_tokens, 256)
    reachable = table.reachable(per_session, 256)
    assert all(table.fit(sizes) == key for key, sizes in reachable.items())
    edges = {edge + step for edge in table.tokens for step in (0, 1)}
    seen = set()  # NOTE: the bucket depends only on the session count, the total rows and the largest block
    for sessions in range(1, max_seqs + 1):
        for largest in range(1, (256 if sessions == 1 else per_session) + 1):
            low, high = sessions - 1 + largest, min(sessions * largest, max_tokens)
            for total in {low, high} | {edge for edge in edges if low <= edge <= high}:
                if low <= high:
                    seen.add(table.fit(spread(total, sessions, largest)))
    assert seen == set(reachable)
    assert table.fit([per_session] * (max_seqs + 1)) is None and table.fit([max_tokens + 1]) is None
    assert table.fit([1] * 4)[2] == 1 and table.fit([1, per_session, 1])[2] >= per_session  # rows: the largest block


@pytest.mark.gpu
def test_graph_replays_equal_the_eager_forward(tiny_target) -> None:
    """One captured bucket serves batches of other prefix lengths, tree shapes and session counts."""
    engine = make_engine(tiny_target, device="cuda", attention="triton", max_batch_tokens=256)
    rng = random.Random(3)
    sessions = [engine.create_session(prompt_of(length, seed=length))[0] for length in (5, 40, 170, 333)]
    used, captured_before = [], set(engine.graphs.graphs)  # the prefills captured some already
    for _ in range(8):
        chosen = rng.sample(sessions, rng.randrange(1, len(sessions) + 1))
        blocks = []
        for session in chosen:
            tree = random_tree(rng, rng.randrange(0, 40), 256, [], rng.choice(["chain", "wide", "random"]))
            session.block_table.prepare_write(session.kv_len, session.kv_len + tree.max_depth() + 1, engine.kv)
            blocks.append(BlockSpec.from_tree(session.kv_len, session.root, tree, session.block_table.pages))
        used.append(engine.graphs.bucket(blocks))
        graphed, _ = engine.forward(blocks)
        eager, _ = engine._forward(build_verify_batch(blocks, engine.device))
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
    new = {key[:3] for key in set(engine.graphs.graphs) - captured_before}
    assert new <= set(used) and len(set(used)) < len(used)  # one capture per bucket, then replays


@pytest.mark.gpu
def test_warm_up_captures_what_the_first_requests_need(tiny_target) -> None:
    engine = make_engine(tiny_target, device="cuda", attention="triton", max_batch_tokens=256)
    tracked = []  # what a progress reporter is handed: one batch per bucket
    assert engine.warm_up(16, lambda todo: tracked.extend(todo) or todo) == len(engine.graphs.graphs) == len(tracked)
    assert tracked
    captured = set(engine.graphs.graphs)
    session, _ = engine.create_session(prompt_of(30))  # prefill chunks of 24 and 5 rows
    engine.start_generation(session.session_id, GREEDY)
    engine.step([(session.session_id, random_tree(random.Random(0), 15, 256, [], "random"))])
    assert set(engine.graphs.graphs) == captured
