"""Sampling with speculation is exact in distribution (chi-square against the exact target law)."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import torch
from scipy.stats import chi2

import verifier_service.engine.engine as engine_module
from modeling.config import ModelConfig, RopeConfig
from modeling.target import CausalLM
from modeling.tree import DraftTree
from tests.engine_helpers import random_tree
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import Engine
from verifier_service.engine.sampling import RowSampling, SamplingParams, choose_tokens, target_distribution

VOCAB = 5
PROMPT = [1, 3, 0, 2]
PARAMS = SamplingParams(temperature=0.8, top_k=4, top_p=0.95, max_new_tokens=2, ignore_eos=True)
SAMPLES = 1500
ALPHA = 1e-3  # significance level: a correct sampler fails this test once in a thousand seeds
MIN_EXPECTED = 5  # the usual floor of a chi-square cell's expected count


def tiny_vocab_engine() -> Engine:
    torch.manual_seed(0)
    config = ModelConfig("Qwen3ForCausalLM", VOCAB, 32, 64, 2, 2, 1, 16, 1e-6, RopeConfig(), 256, qk_norm=True)
    model = CausalLM(config).eval().requires_grad_(False)
    return Engine(model, EngineConfig(page_size=16, kv_budget_bytes=64 << 20, max_batch_tokens=4096))


def exact_law(engine: Engine) -> dict[tuple[int, int], float]:
    """P(first two emitted tokens) by enumeration, with the same temperature/top-k/top-p transform."""
    def next_probs(tokens: list[int]) -> torch.Tensor:
        session, _ = engine.create_session(tokens)
        engine.start_generation(session.session_id, SamplingParams())
        batch = engine_module.build_verify_batch(
            [engine_module.BlockSpec.from_tree(session.kv_len, session.root, DraftTree.empty(),
                                               session.block_table.pages)], engine.device)
        hidden, _ = engine._forward(batch)
        engine.release_session(session.session_id)
        logits = engine.model.logits(hidden)
        return target_distribution(logits, RowSampling.of([PARAMS], [len(logits)], VOCAB, logits.device))[0]

    first = next_probs(PROMPT)
    return {(a, b): float(first[a] * next_probs(PROMPT + [a])[b])
            for a, b in itertools.product(range(VOCAB), repeat=2)}


def sample_first_two(engine: Engine, with_trees: bool) -> list[tuple[int, int]]:
    rng = random.Random(7)
    outcomes = []
    for start in range(0, SAMPLES, 250):
        ids = [engine.create_session(PROMPT)[0].session_id for _ in range(start, min(SAMPLES, start + 250))]
        outputs: dict[str, list[int]] = {sid: [] for sid in ids}
        for i, sid in enumerate(ids):
            engine.start_generation(sid, SamplingParams(**{**PARAMS.__dict__, "seed": start + i}))
        live = list(ids)
        while live:
            work = [(sid, random_tree(rng, rng.randrange(1, 8), VOCAB, [], "random") if with_trees
                     else DraftTree.empty()) for sid in live]
            for result in engine.step(work):
                outputs[result.session_id] += result.emitted
                if result.finished:
                    live.remove(result.session_id)
        for sid in ids:
            outcomes.append(tuple(outputs[sid]))
            engine.release_session(sid)
    return outcomes


def pearson_cells(outcomes: list[tuple[int, int]], law: dict[tuple[int, int], float]) -> tuple[list[int], list[float]]:
    """Observed and expected counts per cell. Cells expected fewer than MIN_EXPECTED times are pooled (the statistic
    is chi-square distributed only with a few per cell); the pool's expectation comes from the law's rare mass, not
    from the total minus the common cells (which rounds below zero when no cell is rare). A pool still short of
    MIN_EXPECTED joins the least likely common cell, as long as two cells remain."""
    scale = len(outcomes) / sum(law.values())
    counts = Counter(outcomes)
    common = sorted((cell for cell, p in law.items() if p * scale >= MIN_EXPECTED), key=law.__getitem__)
    observed = [counts[cell] for cell in common]
    expected = [law[cell] * scale for cell in common]
    rare_observed = len(outcomes) - sum(observed)  # outcomes the law does not name land here too
    rare_expected = sum(p for p in law.values() if p * scale < MIN_EXPECTED) * scale
    if rare_expected < MIN_EXPECTED and len(common) >= 2:
        observed[0] += rare_observed
        expected[0] += rare_expected
    elif rare_observed or rare_expected:
        observed.append(rare_observed)
        expected.append(rare_expected)
    return observed, expected


def chi_square_p(outcomes: list[tuple[int, int]], law: dict[tuple[int, int], float]) -> float:
    """Pearson's p-value of the outcomes under the law; 1.0 when a single cell is left (nothing to compare)."""
    observed, expected = pearson_cells(outcomes, law)
    if len(observed) < 2:
        return 1.0
    # Only a pool of outcomes that the law rules out is kept with an expectation of 0: p is 0.
    statistic = sum((o - e) ** 2 / e if e else math.inf for o, e in zip(observed, expected))
    return float(chi2.sf(statistic, len(observed) - 1))


def counts_to_outcomes(counts: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
    return [cell for cell, count in counts.items() for _ in range(count)]


NO_RARE_CELL = {(0, i): w / 17 for i, w in enumerate([3, 6, 6, 2])}  # n=170: the old pool's expectation was -3e-14
ONE_CELL = {(0, 0): 1.0, (0, 1): 0.0}
SMALL_POOL = {(0, 0): 0.5, (0, 1): 0.49, (1, 0): 0.005, (1, 1): 0.005}  # n=200: the two rare cells expect 2 in all


@pytest.mark.parametrize(("law", "counts"), [
    (NO_RARE_CELL, {(0, 0): 30, (0, 1): 60, (0, 2): 60, (0, 3): 20}),
    (NO_RARE_CELL, {(0, 0): 20, (0, 1): 70, (0, 2): 50, (0, 3): 30}),
    (ONE_CELL, {(0, 0): 50}),
    (ONE_CELL, {(0, 0): 49, (0, 1): 1}),
    (SMALL_POOL, {(0, 0): 100, (0, 1): 98, (1, 0): 1, (1, 1): 1}),
    (SMALL_POOL, {(0, 0): 100, (0, 1): 90, (1, 0): 10}),
    (SMALL_POOL, {(0, 0): 200}),
    ({(0, 0): 0.99, (0, 1): 0.01}, {(0, 0): 97, (0, 1): 3}),  # one common cell: the small pool stays a cell
    (SMALL_POOL, {}),
], ids=["no-rare", "no-rare-off", "one-cell", "one-cell-ruled-out", "small-pool", "small-pool-off", "all-in-one",
        "one-common-cell", "no-samples"])
def test_chi_square_p_is_a_probability_on_edge_inputs(law, counts) -> None:
    p = chi_square_p(counts_to_outcomes(counts), law)
    assert math.isfinite(p) and 0.0 <= p <= 1.0, p


def test_chi_square_p_on_edge_inputs_says_what_it_should() -> None:
    exact = {(0, 0): 30, (0, 1): 60, (0, 2): 60, (0, 3): 20}
    assert chi_square_p(counts_to_outcomes(exact), NO_RARE_CELL) == pytest.approx(1.0)
    assert chi_square_p(counts_to_outcomes({(0, 0): 50}), ONE_CELL) == 1.0  # nothing else could happen
    assert chi_square_p(counts_to_outcomes({(0, 0): 49, (0, 1): 1}), ONE_CELL) == 0.0  # an outcome ruled out
    assert chi_square_p(counts_to_outcomes({(0, 0): 200}), SMALL_POOL) < ALPHA


@pytest.fixture(scope="module")
def engine_and_law():
    engine = tiny_vocab_engine()
    return engine, exact_law(engine)


@pytest.mark.parametrize("with_trees", [False, True], ids=["plain", "speculative"])
def test_sampling_matches_the_target_distribution(engine_and_law, with_trees: bool) -> None:
    engine, law = engine_and_law
    assert chi_square_p(sample_first_two(engine, with_trees), law) > ALPHA


def test_the_test_detects_a_biased_sampler(engine_and_law, monkeypatch) -> None:
    """Negative control: accepting the first drafted child unconditionally must be caught."""
    engine, law = engine_and_law

    def biased_accept(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
        children = [i for i, p in enumerate(tree.parents) if p == -1]
        return (children[:1], target_tokens[1 + children[0]]) if children else ([], target_tokens[0])

    monkeypatch.setattr(engine_module, "accept_path", biased_accept)
    assert chi_square_p(sample_first_two(engine, with_trees=True), law) < ALPHA


def rows_of(*params: SamplingParams, rows: int = 1) -> RowSampling:
    return RowSampling.of(list(params), [rows] * len(params), 5, torch.device("cpu"))


def test_top_k_and_top_p_shape_the_distribution() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = target_distribution(logits, rows_of(SamplingParams(temperature=1.0, top_k=3)))
    assert (probs[0, 3:] == 0).all() and probs[0, :3].sum().item() == pytest.approx(1.0)
    probs = target_distribution(logits, rows_of(SamplingParams(temperature=1.0, top_p=0.5)))
    assert probs[0, 0].item() == pytest.approx(1.0)  # the top token alone already holds > 0.5


def test_each_row_of_a_batch_takes_its_own_sessions_settings() -> None:
    """One pass over the rows of sessions with other temperatures, top-k and top-p gives each row the distribution
    its session's settings alone give it; greedy rows take their argmax."""
    settings = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.5),
                SamplingParams(temperature=2.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=9)]
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(4, 1)
    batch = target_distribution(logits, RowSampling.of(settings, [2] * 4, 5, torch.device("cpu")))
    for i, params in enumerate(settings):
        alone = target_distribution(logits[2 * i: 2 * i + 2], rows_of(params, rows=2))
        torch.testing.assert_close(batch[2 * i: 2 * i + 2], alone)
    mixed = RowSampling.of([SamplingParams(), settings[1]], [2, 2], 5, torch.device("cpu"))
    tokens = choose_tokens(logits[:4], mixed, torch.tensor([0.99, 0.99, 0.0, 1.0 - 2 ** -24]))
    assert tokens.tolist() == [0, 4, 0, 4]  # NOTE: argmax, argmax, then the draws at each end of the CDF


def test_a_draw_picks_the_token_whose_share_of_the_cdf_holds_it() -> None:
    """The inverse CDF never lands on a token of no mass, whatever the draw."""
    logits = torch.tensor([[0.0, 0.0, -math.inf, 0.0, -math.inf]]).repeat(5, 1)
    rows = rows_of(SamplingParams(temperature=1.0), rows=5)
    draws = torch.tensor([0.0, 0.3, 1 / 3, 0.7, 1.0 - 2 ** -24])
    assert choose_tokens(logits, rows, draws).tolist() == [0, 0, 1, 3, 3]
