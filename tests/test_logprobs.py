"""The logprobs of emitted tokens in the engine: those of the target's raw distribution at the rows plain decoding
reads (transformers' own logits are the reference), under speculation and decode bursts alike, and nothing
computed for sessions that do not ask; and how the OpenAI API spells them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gateway.openai_logprobs import ChoiceLogprobs, TokenSpelling
from modeling.tiny import byte_level_tokenizer
from modeling.tokenizer import Tokenizer
from modeling.tree import DraftTree
from proto import common_pb2
from tests.engine_helpers import burst_to_end, make_engine, planted_trees, run_to_end
from verifier_service.engine.engine import Engine, StepResult
from verifier_service.engine.logprobs import TokenLogprob
from verifier_service.engine.prefill import Prefill
from verifier_service.engine.sampling import SamplingParams
from verifier_service.errors import InvalidArgument

PROMPT = [5, 17, 99, 3, 250, 41, 8]
GREEDY_LP = SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=5)
SAMPLED_LP = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3, max_new_tokens=30, ignore_eos=True,
                            logprobs=5)


def generate(engine: Engine, params: SamplingParams, next_tree=lambda _: DraftTree.empty(),
             prompt: list[int] = PROMPT) -> tuple[list[int], list[TokenLogprob], list[StepResult]]:
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, params)
    tokens, results = run_to_end(engine, session.session_id, next_tree)
    engine.release_session(session.session_id)
    return tokens, logprobs_of(results), results


def logprobs_of(results: list[StepResult]) -> list[TokenLogprob]:
    assert all(len(r.logprobs) == len(r.emitted) for r in results)
    return [lp for r in results for lp in r.logprobs]


def assert_matches_reference(tokens: list[int], logprobs: list[TokenLogprob], reference: torch.Tensor,
                             width: int) -> None:
    """Each token's logprob and its row's `width` best tokens equal the reference's row that predicted it."""
    assert_rows_match(tokens, logprobs, reference[len(PROMPT) - 1: len(PROMPT) - 1 + len(tokens)], width)


def assert_rows_match(tokens: list[int], logprobs: list[TokenLogprob], rows: torch.Tensor, width: int) -> None:
    """Token i's logprob and the `width` best tokens equal those of `rows[i]`, the reference's row that predicted
    it."""
    assert len(logprobs) == len(tokens) == len(rows)
    got = torch.tensor([lp.logprob for lp in logprobs])
    torch.testing.assert_close(got, rows.gather(-1, torch.tensor(tokens)[:, None])[:, 0], atol=2e-5, rtol=1e-4)
    top = rows.topk(width, dim=-1)
    assert [list(lp.top_ids) for lp in logprobs] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([lp.top_logprobs for lp in logprobs]), top.values, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("params", [GREEDY_LP, SAMPLED_LP], ids=["greedy", "sampled"])
def test_speculative_logprobs_equal_plain_decodings_and_transformers(tiny_target, hf_logprobs, params) -> None:
    engine = make_engine(tiny_target, max_tree_nodes=64)
    plain, plain_logprobs, _ = generate(engine, params)
    assert_matches_reference(plain, plain_logprobs, hf_logprobs(PROMPT + plain), params.logprobs)
    speculative, spec_logprobs, results = generate(engine, params, planted_trees(plain))
    if params.greedy:
        assert speculative == plain and any(r.acceptance_length > 2 for r in results)
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in spec_logprobs]),
                                   torch.tensor([lp.logprob for lp in plain_logprobs]), atol=1e-5, rtol=1e-5)
        assert all(lp.top_ids[0] == token and lp.top_logprobs[0] == lp.logprob
                   for token, lp in zip(plain, spec_logprobs))  # the argmax leads its own alternatives
    # NOTE: a sampled speculative generation draws other tokens (one draw per tree row): its own are the reference
    assert_matches_reference(speculative, spec_logprobs, hf_logprobs(PROMPT + speculative), params.logprobs)
    assert all(list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True) for lp in spec_logprobs)


@pytest.mark.parametrize("params", [GREEDY_LP, SAMPLED_LP], ids=["greedy", "sampled"])
def test_burst_logprobs_equal_single_steps(tiny_target, params) -> None:
    engine = make_engine(tiny_target)
    expected, expected_logprobs, _ = generate(engine, params)
    session, _ = engine.create_session(PROMPT)
    engine.start_generation(session.session_id, params)
    first = engine.step([(session.session_id, DraftTree.empty())])
    results = first + burst_to_end(engine, [session.session_id], steps=7)[session.session_id]
    assert max(len(r.emitted) for r in results) == 7
    assert [t for r in results for t in r.emitted] == expected
    assert [lp.top_ids for lp in logprobs_of(results)] == [lp.top_ids for lp in expected_logprobs]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in logprobs_of(results)]),
                               torch.tensor([lp.logprob for lp in expected_logprobs]), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_logprobs_on_the_gpu_under_graphs_speculation_and_bursts(tiny_target, hf_logprobs) -> None:
    """The CUDA paths: graph replays beside the logits of the asking rows, the non-blocking read-back, bursts;
    against transformers' fp32 on the CPU (the kernels sum in another order: a looser bound)."""
    engine = make_engine(tiny_target, device="cuda", attention="triton", max_tree_nodes=64)
    plain, plain_logprobs, _ = generate(engine, GREEDY_LP)
    speculative, spec_logprobs, results = generate(engine, GREEDY_LP, planted_trees(plain))
    assert speculative == plain and any(r.acceptance_length > 2 for r in results)
    session, _ = engine.create_session(PROMPT)
    engine.start_generation(session.session_id, GREEDY_LP)
    first = engine.step([(session.session_id, DraftTree.empty())])
    bursts = first + burst_to_end(engine, [session.session_id], steps=8)[session.session_id]
    assert [t for r in bursts for t in r.emitted] == plain and max(len(r.emitted) for r in bursts) == 8
    reference = hf_logprobs(PROMPT + plain)[len(PROMPT) - 1:][: len(plain)]
    expected = reference.gather(-1, torch.tensor(plain)[:, None])[:, 0]
    for logprobs in (plain_logprobs, spec_logprobs, logprobs_of(bursts)):
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in logprobs]), expected, atol=1e-2, rtol=1e-2)
        assert all(lp.top_ids[0] == token for token, lp in zip(plain, logprobs))


def step_together(engine: Engine, params: list[SamplingParams], trees) -> list[list[StepResult]]:
    """Sessions on PROMPT-like prompts stepped in one batch until all finish; each session's results."""
    ids = []
    for i, p in enumerate(params):
        session, _ = engine.create_session(PROMPT + [i])
        engine.start_generation(session.session_id, p)
        ids.append(session.session_id)
    results: list[list[StepResult]] = [[] for _ in params]
    live = list(range(len(params)))
    while live:
        emitted = [[t for r in results[i] for t in r.emitted] for i in live]
        step = engine.step([(ids[i], trees[i](e)) for i, e in zip(live, emitted)])
        for i, result in zip(list(live), step):
            results[i].append(result)
            if result.finished:
                live.remove(i)
    for sid in ids:
        engine.release_session(sid)
    return results


@pytest.mark.parametrize("other", [SamplingParams(max_new_tokens=20, ignore_eos=True),
                                   SamplingParams(temperature=1.0, seed=11, max_new_tokens=20, ignore_eos=True)],
                         ids=["greedy-batch", "sampled-batch"])
def test_one_session_asking_leaves_the_others_outputs_as_they_were(tiny_target, other) -> None:
    engine = make_engine(tiny_target, max_tree_nodes=64)
    asking = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2)
    empty = [lambda _: DraftTree.empty()] * 2
    alone = step_together(engine, [other, dataclasses.replace(asking, logprobs=None)], empty)
    together = step_together(engine, [other, asking], empty)
    assert [r.emitted for r in together[0]] == [r.emitted for r in alone[0]]
    assert all(r.logprobs is None for r in together[0] + alone[1])
    assert [r.emitted for r in together[1]] == [r.emitted for r in alone[1]]
    asked = logprobs_of(together[1])
    assert len(asked) == 20 and all(len(lp.top_ids) == 2 for lp in asked)


def test_a_greedy_batch_without_logprobs_computes_no_full_logits(tiny_target, monkeypatch) -> None:
    engine = make_engine(tiny_target)

    def refused(*args):
        raise AssertionError("full logits computed for a greedy batch that asked for no logprobs")
    monkeypatch.setattr(engine.model, "logits", refused)
    tokens, _ = run_greedy(engine, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(tokens) == 8
    with pytest.raises(AssertionError, match="full logits"):
        run_greedy(engine, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=0))


def run_greedy(engine: Engine, params: SamplingParams) -> tuple[list[int], list[StepResult]]:
    session, _ = engine.create_session(PROMPT)
    engine.start_generation(session.session_id, params)
    try:
        return run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
    finally:
        engine.release_session(session.session_id)


@pytest.mark.parametrize("logprobs", [-1, 21])
def test_logprobs_out_of_range_are_refused(tiny_target, logprobs: int) -> None:
    with pytest.raises(InvalidArgument, match="logprobs"):
        SamplingParams(logprobs=logprobs).validate()
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        make_engine(tiny_target).begin_session(PROMPT, prompt_logprobs=logprobs)


LONG_PROMPT = [1 + (i * 37) % 250 for i in range(61)]  # NOTE: 60 rows: chunks of 24, 24, 12


def prefilled(prefill: Prefill) -> list[TokenLogprob]:
    prefill.run(lambda: False, lambda done, total: None)
    return prefill.logprobs


def assert_prompt_matches(tokens: list[int], logprobs: list[TokenLogprob], rows: torch.Tensor, width: int) -> None:
    """As assert_rows_match, and each token's rank in its row is the reference's (1 + the tokens more likely)."""
    assert_rows_match(tokens, logprobs, rows, width)
    chosen = rows.gather(-1, torch.tensor(tokens)[:, None])
    assert [lp.rank for lp in logprobs] == (1 + (rows > chosen).sum(-1)).tolist()


def test_prompt_logprobs_equal_transformers_across_prefill_chunks_and_logit_slices(tiny_target, hf_logprobs) -> None:
    """Every prompt token but the first, given the tokens before it, from the prefill's own rows: chunks of 24 rows,
    logits in slices of 7 rows that cross the chunks' ends."""
    engine = make_engine(tiny_target, prefill_chunk=24, prompt_logprob_rows=7)
    logprobs = prefilled(engine.begin_session(LONG_PROMPT, prompt_logprobs=4))
    assert_prompt_matches(LONG_PROMPT[1:], logprobs, hf_logprobs(LONG_PROMPT)[:-1], 4)
    assert sum(lp.rank == 1 for lp in logprobs) < len(logprobs)  # NOTE: the random prompt is not the model's argmax


def test_prompt_logprobs_of_turns_appended_to_a_session_and_its_fork(tiny_target, hf_logprobs) -> None:
    """A session's KV is reused by a later turn (keep_session) and by a fork: their prefills score the appended
    tokens alone, each given the whole session before it (its first too); what the session held is not scored
    again, and the gateway counts on that."""
    engine = make_engine(tiny_target, prefill_chunk=24, prompt_logprob_rows=5)
    head, turn = LONG_PROMPT[:29], LONG_PROMPT[29:]
    engine.create_session(head, "head")
    reference = hf_logprobs(LONG_PROMPT)[:-1]
    fork = engine.fork_session("head")
    for sid in (fork.session_id, "head"):
        logprobs = prefilled(engine.begin_extend(sid, turn, prompt_logprobs=0))
        assert_prompt_matches(turn, logprobs, reference[len(head) - 1:], 0)
    assert engine.session("head").tokens == engine.session(fork.session_id).tokens == LONG_PROMPT


def test_a_prompt_of_one_token_has_nothing_to_score(tiny_target) -> None:
    assert prefilled(make_engine(tiny_target).begin_session([7], prompt_logprobs=3)) == []


def test_tokens_are_spelled_on_their_own_with_their_raw_bytes() -> None:
    spelling = TokenSpelling(Tokenizer(byte_level_tokenizer()))  # NOTE: token id b is byte b
    assert [spelling.text(b) for b in "é".encode()] == ["\\xc3", "\\xa9"]  # neither byte is UTF-8 on its own
    assert spelling.bytes(0xC3) == b"\xc3" and spelling.text(256) == "<|endoftext|>"
    assert spelling.entry(ord("a"), -1.5) == {"token": "a", "logprob": -1.5, "bytes": [97]}


def test_completions_alternatives_hold_the_chosen_token_and_offsets_run_on_across_chunks() -> None:
    logprobs = ChoiceLogprobs(TokenSpelling(Tokenizer(byte_level_tokenizer())), chat=False)
    sampled = common_pb2.TokenLogprob(logprob=-3.0, top_token_ids=[ord("x"), ord("y")], top_logprobs=[-0.5, -1.0])
    first = logprobs([ord("a"), 0xC3], [sampled, sampled])
    assert first["tokens"] == ["a", "\\xc3"] and first["token_logprobs"] == [-3.0, -3.0]
    assert first["top_logprobs"][0] == {"x": -0.5, "y": -1.0, "a": -3.0}  # N best, and the chosen one
    assert first["text_offset"] == [0, 1] and logprobs([ord("b")], [sampled])["text_offset"] == [5]


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_chunk", [24, 512], ids=["graphed-chunks", "prefill-path"])
def test_prompt_logprobs_on_the_gpu(tiny_target, hf_logprobs, prefill_chunk: int) -> None:
    """The CUDA paths: chunks short enough for the graphs' verify blocks (their hidden rows a graph's output) and a
    long chunk through the fused prefill attention; against transformers' fp32 on the CPU (a looser bound)."""
    engine = make_engine(tiny_target, device="cuda", attention="triton", prefill_chunk=prefill_chunk,
                         prompt_logprob_rows=7)
    prompt = [1 + (i * 37) % 250 for i in range(300)]
    logprobs = prefilled(engine.begin_session(prompt, prompt_logprobs=4))
    reference = hf_logprobs(prompt)[:-1]
    expected = reference.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in logprobs]), expected, atol=1e-2, rtol=1e-2)
    assert [lp.top_ids[0] for lp in logprobs] == reference.argmax(-1).tolist()
