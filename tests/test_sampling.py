"""Sampling with speculation is exact in distribution (chi-square against the exact target law)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from scipy.stats import chisquare

import verifier_service.engine.engine as engine_module
from modeling.config import ModelConfig, RopeConfig
from modeling.target import CausalLM
from modeling.tree import DraftTree
from tests.engine_helpers import random_tree
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import Engine
from verifier_service.engine.sampling import SamplingParams, target_distribution

VOCAB = 5
PROMPT = [1, 3, 0, 2]
PARAMS = SamplingParams(temperature=0.8, top_k=4, top_p=0.95, max_new_tokens=2, ignore_eos=True)
SAMPLES = 1500
ALPHA = 1e-3  # significance level: a correct sampler fails this test once in a thousand seeds


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
        return target_distribution(engine.model.logits(hidden), PARAMS)[0]

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


def chi_square_p(outcomes: list[tuple[int, int]], law: dict[tuple[int, int], float]) -> float:
    cells = [cell for cell, p in law.items() if p * len(outcomes) >= 5]  # pool rare cells into one
    observed = [sum(o == cell for o in outcomes) for cell in cells]
    expected = [law[cell] * len(outcomes) for cell in cells]
    observed.append(len(outcomes) - sum(observed))
    expected.append(len(outcomes) - sum(expected))
    return chisquare(observed, expected).pvalue


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


def test_top_k_and_top_p_shape_the_distribution() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = target_distribution(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (probs[0, 3:] == 0).all() and probs[0, :3].sum().item() == pytest.approx(1.0)
    probs = target_distribution(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert probs[0, 0].item() == pytest.approx(1.0)  # the top token alone already holds > 0.5
