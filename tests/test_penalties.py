"""Repetition, presence and frequency penalties and logit_bias in the engine: greedy output equals a reference
decoded by hand over transformers' logits, under speculation (each tree row counts the draft tokens on its path),
in decode bursts, and in batches whose other sessions' outputs stay as they were; logprobs stay raw."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import transformers

from modeling.tree import DraftTree
from proto import common_pb2
from tests.engine_helpers import burst_to_end, emitted_of, make_engine, planted_trees, run_to_end
from verifier_service.engine.engine import Engine, StepResult
from verifier_service.engine.penalties import AdjustedRows, BurstCounts, PenaltyState, adjust, count, path_tokens
from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.verify_batch import BlockSpec
from verifier_service.errors import InvalidArgument
from verifier_service.servicer import params_from_pb

PROMPT = [5, 17, 99, 3, 250, 41, 8, 17, 99]
PLAIN = SamplingParams(max_new_tokens=24, ignore_eos=True)
PENALTIES = {
    "repetition": dataclasses.replace(PLAIN, repetition_penalty=1.8),
    "repetition-below-1": dataclasses.replace(PLAIN, repetition_penalty=0.6),
    "presence": dataclasses.replace(PLAIN, presence_penalty=2.0),
    "frequency": dataclasses.replace(PLAIN, frequency_penalty=1.5),
    "negative-frequency": dataclasses.replace(PLAIN, frequency_penalty=-2.0),
    "bias": dataclasses.replace(PLAIN, logit_bias=((7, 3.0), (300, -100.0), (41, 2.5))),
    "all": dataclasses.replace(
        PLAIN, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7, logit_bias=((7, 2.0),)
    ),
}
REPEATING = ("repetition-below-1", "negative-frequency", "all")  # NOTE: their outputs repeat a token in one path

# NOTE: paths of 1 to 8 true tokens: deep enough that an accepted path repeats a token
deep_planted_trees = functools.partial(planted_trees, min_depth=1, max_depth=8)


def adjusted_by_hand(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """One position's logits [V] adjusted as vLLM does, token by token: bias, repetition, frequency, presence."""
    logits = logits.clone()
    for token, bias in params.logit_bias:
        logits[token] += bias
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return logits


@pytest.fixture(scope="module")
def hf_model(tiny_target):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Plain greedy decoding with the penalties, one transformers forward per token."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(adjusted_by_hand(logits, prompt, output, params).argmax()))
    return output


@pytest.fixture(scope="module")
def engine(tiny_target) -> Engine:
    return make_engine(tiny_target, max_tree_nodes=64)


@pytest.fixture(scope="module")
def references(hf_model) -> dict[str, list[int]]:
    return {name: reference_greedy(hf_model, PROMPT, params) for name, params in PENALTIES.items()}


def generate(
    engine: Engine, params: SamplingParams, next_tree=lambda _: DraftTree.empty(), prompt: list[int] = PROMPT
) -> tuple[list[int], list[StepResult]]:
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, params)
    try:
        return run_to_end(engine, session.session_id, next_tree)
    finally:
        engine.release_session(session.session_id)


@pytest.mark.parametrize("name", list(PENALTIES))
def test_plain_greedy_with_penalties_equals_the_reference(engine, references, name) -> None:
    tokens, _ = generate(engine, PENALTIES[name])
    assert tokens == references[name]


def test_the_penalties_change_the_output(engine, references) -> None:
    plain, _ = generate(engine, PLAIN)
    assert all(references[name] != plain for name in PENALTIES)


@pytest.mark.parametrize("name", list(PENALTIES))
def test_speculative_greedy_with_penalties_equals_the_reference(engine, references, name) -> None:
    expected = references[name]
    tokens, results = generate(engine, PENALTIES[name], deep_planted_trees(expected))
    assert tokens == expected
    assert any(r.acceptance_length > 3 for r in results)
    if name in REPEATING:  # a deeper row counts a token its path already holds
        assert any(len(set(r.accepted)) < len(r.accepted) for r in results)


def test_a_path_that_repeats_a_token_counts_it_at_every_row_below() -> None:
    """The tree of a repetitive continuation: rows deep in the path see the path's repeats."""
    # root 9; nodes: 0 = 4 (depth 1, wrong sibling), 1 = 5 (depth 1), 2 = 5 (under 1), 3 = 6 (under 2), 4 = 5 (under 3)
    tree = DraftTree((4, 5, 5, 6, 5), (-1, -1, 1, 2, 3), (1, 1, 2, 3, 4))
    block = BlockSpec.from_tree(10, 9, tree, [])
    rows, path = path_tokens(block.tokens, block.parent_rows)
    per_row = [sorted(t for r, t in zip(rows, path) if r == row) for row in range(len(block.tokens))]
    assert per_row == [[], [4], [5], [5, 5], [5, 5, 6], [5, 5, 5, 6]]

    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4)
    prompt, output = [1, 2, 6], [5, 7]
    adjustment = PenaltyState(16, torch.device("cpu")).adjustment(params, prompt)
    count([(adjustment, output)])
    logits = torch.randn(len(block.tokens), 16, generator=torch.Generator().manual_seed(0))
    got = adjust(logits, [AdjustedRows(adjustment, block.tokens, block.parent_rows, 0)])
    for row in range(len(block.tokens)):
        torch.testing.assert_close(got[row], adjusted_by_hand(logits[row], prompt, output + per_row[row], params))


def test_the_sessions_of_a_batch_are_adjusted_in_one_pass_each_as_by_hand() -> None:
    """Rows of sessions with other biases and penalties, adjusted together: each row is its session's logits adjusted
    by hand with its output and its own path; a session without adjustments between them keeps its rows as they
    were."""
    tree = DraftTree((4, 5, 5), (-1, -1, 1), (1, 1, 2))
    block = BlockSpec.from_tree(10, 9, tree, [])
    paths = [[], [4], [5], [5, 5]]  # NOTE: each row's draft tokens from the root down (root excluded)
    state, rows = PenaltyState(16, torch.device("cpu")), len(block.tokens)
    settings = [(SamplingParams(repetition_penalty=1.3, logit_bias=((3, 2.0),)), [1, 2, 6], [5, 7]),
                (SamplingParams(frequency_penalty=0.5, presence_penalty=0.2), [2], [4, 4]),
                (SamplingParams(logit_bias=((0, -5.0), (9, 1.5))), [0], [])]
    sessions = []
    for (params, prompt, _), start in zip(settings, (0, rows, 3 * rows)):  # NOTE: rows 2r..3r: nobody's
        sessions.append(AdjustedRows(state.adjustment(params, prompt), block.tokens, block.parent_rows, start))
    count([(session.adjustment, output) for session, (_, _, output) in zip(sessions, settings)])
    logits = torch.randn(4 * rows, 16, generator=torch.Generator().manual_seed(1))
    got = adjust(logits, sessions)
    for (params, prompt, output), session in zip(settings, sessions):
        counted = output if params.penalized else []
        for row in range(rows):
            at = session.start + row
            torch.testing.assert_close(got[at], adjusted_by_hand(logits[at], prompt, counted + paths[row], params))
    assert torch.equal(got[2 * rows: 3 * rows], logits[2 * rows: 3 * rows])


def test_a_step_counts_every_sessions_tokens_in_its_own_slot() -> None:
    """One count for several sessions (a token twice in one output counts twice; an unpenalized session's output is
    not counted), and a burst's counts at its penalized sessions' rows alone."""
    state = PenaltyState(8, torch.device("cpu"))
    frequency, bias = SamplingParams(frequency_penalty=0.5), SamplingParams(logit_bias=((1, 1.0),))
    first, second = state.adjustment(frequency, [1]), state.adjustment(frequency, [2])
    biased = state.adjustment(bias, [])
    count([(first, [3, 3, 4]), (biased, [5]), (second, [4])])
    assert state.counts[first.slot].tolist() == [0, 0, 0, 2, 1, 0, 0, 0]
    assert state.counts[second.slot].tolist() == [0, 0, 0, 0, 1, 0, 0, 0]
    assert state.counts[biased.slot].sum() == 0
    burst = BurstCounts.of([(0, first), (1, biased), (2, second)])
    burst.count(torch.tensor([7, 6, 0]))
    assert state.counts[first.slot, 7] == 1 and state.counts[second.slot, 0] == 1
    assert state.counts[biased.slot].sum() == 0
    assert BurstCounts.of([(1, biased)]) is None


def test_a_dropped_generations_slot_is_taken_again_and_starts_empty() -> None:
    """Generations one after another reuse the state's slots (it does not grow), each starting with no counts and only
    its own prompt marked; those alive at once each have their own."""
    state = PenaltyState(32, torch.device("cpu"))
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)
    for turn in range(40):
        adjustment = state.adjustment(params, [turn % 8])
        assert state.counts[adjustment.slot].sum() == 0
        assert state.in_prompt[adjustment.slot].nonzero().flatten().tolist() == [turn % 8]
        count([(adjustment, [turn % 8, 1])])
        del adjustment
    assert len(state.counts) == 8
    alive = [state.adjustment(params, [i]) for i in range(20)]
    assert len({a.slot for a in alive}) == 20 and len(state.counts) == 32
    assert [state.in_prompt[a.slot].nonzero().flatten().tolist() for a in alive[:8]] == [[i] for i in range(8)]


def test_penalties_in_a_batch_leave_the_other_sessions_outputs_as_they_were(engine, references) -> None:
    others = [PLAIN, SamplingParams(temperature=0.9, seed=5, max_new_tokens=24, ignore_eos=True)]
    alone = [generate(engine, p, prompt=[3, 1, 4, 1, 5])[0] for p in others]
    penalized = PENALTIES["all"]
    ids = []
    for params, prompt in zip([penalized, *others], [PROMPT, [3, 1, 4, 1, 5], [3, 1, 4, 1, 5]]):
        session, _ = engine.create_session(prompt)
        engine.start_generation(session.session_id, params)
        ids.append(session.session_id)
    trees = [deep_planted_trees(references["all"]), lambda _: DraftTree.empty(), lambda _: DraftTree.empty()]
    outputs: dict[str, list[int]] = {sid: [] for sid in ids}
    live = list(ids)
    while live:
        step = engine.step([(sid, trees[ids.index(sid)](outputs[sid])) for sid in live])
        for result in step:
            outputs[result.session_id] += result.emitted
            if result.finished:
                live.remove(result.session_id)
    for sid in ids:
        engine.release_session(sid)
    assert [outputs[sid] for sid in ids] == [references["all"], *alone]


@pytest.mark.parametrize("name", ["repetition", "frequency", "all"])
def test_decode_bursts_with_penalties_equal_the_reference(engine, references, name) -> None:
    """Each burst step's choice joins the counts on the device before the next step's."""
    sessions = []
    for params in (PENALTIES[name], PLAIN):
        session, _ = engine.create_session(PROMPT)
        engine.start_generation(session.session_id, params)
        sessions.append(session.session_id)
    results = burst_to_end(engine, sessions, steps=5)
    for sid in sessions:
        engine.release_session(sid)
    assert max(len(r.emitted) for r in results[sessions[0]]) == 5
    assert emitted_of(results[sessions[0]]) == references[name]
    assert emitted_of(results[sessions[1]]) == generate(engine, PLAIN)[0]


def test_a_seeded_sampled_generation_with_penalties_replays(engine, references) -> None:
    params = dataclasses.replace(PENALTIES["all"], temperature=1.0, top_p=0.95, seed=7)
    first, _ = generate(engine, params)
    assert generate(engine, params)[0] == first
    assert generate(engine, dataclasses.replace(params, seed=8))[0] != first
    speculative, _ = generate(engine, params, deep_planted_trees(first))
    assert len(speculative) == params.max_new_tokens  # a draw per row: its own tokens, exact in distribution


def test_a_full_logit_bias_forces_its_token(engine) -> None:
    tokens, _ = generate(engine, dataclasses.replace(PLAIN, logit_bias=((123, 100.0),)), deep_planted_trees([123] * 24))
    assert tokens == [123] * 24


def test_logprobs_stay_raw_under_penalties(engine, hf_model, references) -> None:
    params = dataclasses.replace(PENALTIES["all"], logprobs=3)
    tokens, results = generate(engine, params, deep_planted_trees(references["all"]))
    assert tokens == references["all"]
    with torch.no_grad():
        raw = hf_model(torch.tensor([PROMPT + tokens])).logits[0].log_softmax(-1)[len(PROMPT) - 1 : -1]
    got = torch.tensor([lp.logprob for r in results for lp in r.logprobs])
    torch.testing.assert_close(got, raw.gather(-1, torch.tensor(tokens)[:, None])[:, 0], atol=2e-5, rtol=1e-4)


def test_a_batch_without_adjustments_computes_no_full_logits(engine, monkeypatch) -> None:
    def refused(*args):
        raise AssertionError("full logits computed for a greedy batch without penalties")

    monkeypatch.setattr(engine.model, "logits", refused)
    assert len(generate(engine, PLAIN)[0]) == PLAIN.max_new_tokens
    with pytest.raises(AssertionError, match="full logits"):
        generate(engine, dataclasses.replace(PLAIN, presence_penalty=0.1))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
        ({"logit_bias": tuple((t, 1.0) for t in range(301))}, "logit_bias"),
    ],
)
def test_bad_values_are_refused_naming_the_field(change, field) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        SamplingParams(**change).validate()


def test_a_logit_bias_outside_the_vocabulary_is_refused(engine) -> None:
    session, _ = engine.create_session(PROMPT)
    try:
        with pytest.raises(InvalidArgument, match=r"logit_bias: token 320 is outside the vocabulary \(0\.\.319\)"):
            engine.start_generation(session.session_id, dataclasses.replace(PLAIN, logit_bias=((320, 1.0),)))
        assert engine.session(session.session_id).generation is None
    finally:
        engine.release_session(session.session_id)


@pytest.mark.gpu
def test_penalties_on_the_gpu_under_graphs_speculation_and_bursts(tiny_target, references) -> None:
    """The CUDA paths: graph replays with the head outside them, the counts on the device, bursts; equal to the
    reference decoded on the CPU (a tiny fp32 model: no near ties)."""
    gpu = make_engine(tiny_target, device="cuda", attention="triton", max_tree_nodes=64)
    for name in ("repetition", "negative-frequency", "all"):
        expected = references[name]
        assert generate(gpu, PENALTIES[name])[0] == expected
        tokens, results = generate(gpu, PENALTIES[name], deep_planted_trees(expected))
        assert tokens == expected and any(r.acceptance_length > 3 for r in results)
        session, _ = gpu.create_session(PROMPT)
        gpu.start_generation(session.session_id, PENALTIES[name])
        bursts = burst_to_end(gpu, [session.session_id], steps=6)[session.session_id]
        gpu.release_session(session.session_id)
        assert emitted_of(bursts) == expected and max(len(r.emitted) for r in bursts) == 6


def test_the_verifiers_params_from_the_wire() -> None:
    wire = common_pb2.SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={9: -1.0, 3: 2.0})
    params = params_from_pb(wire)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.5, -0.25)
    assert params.logit_bias == ((3, 2.0), (9, -1.0))
    wire.repetition_penalty = 1.25
    assert params_from_pb(wire).repetition_penalty == 1.25
    assert not params_from_pb(common_pb2.SamplingParams()).adjusts_logits
