"""Helpers for engine tests: a tiny engine, plain decoding, and random draft trees."""

from __future__ import annotations

import random

import torch

from modeling.config import ModelConfig
from modeling.tree import DraftTree
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import Engine, StepResult
from verifier_service.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def make_engine(checkpoint, **overrides) -> Engine:
    config = EngineConfig(**{"page_size": 16, "kv_budget_bytes": 4 << 20, "prefill_chunk": 24, **overrides})
    return Engine.from_checkpoint(checkpoint, config)


def run_to_end(engine: Engine, session_id: str, next_tree) -> tuple[list[int], list[StepResult]]:
    """Step one session until it finishes; `next_tree(emitted_so_far)` supplies each draft."""
    emitted: list[int] = []
    results: list[StepResult] = []
    while True:
        (result,) = engine.step([(session_id, next_tree(emitted))])
        emitted += result.emitted
        results.append(result)
        if result.finished:
            return emitted, results


def plain_generate(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    session, _ = engine.create_session(prompt)
    engine.start_generation(session.session_id, params)
    tokens, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
    engine.release_session(session.session_id)
    return tokens


def burst_to_end(engine: Engine, session_ids: list[str], steps: int) -> dict[str, list[StepResult]]:
    """Decode the sessions in bursts of up to `steps` plain steps, dropping each as it finishes, as the step loop
    does; each session's results."""
    results: dict[str, list[StepResult]] = {sid: [] for sid in session_ids}
    live = list(session_ids)
    while live:
        for result in engine.decode(live, engine.burst_length(live, steps)):
            results[result.session_id].append(result)
            if result.finished:
                live.remove(result.session_id)
    return results


def emitted_of(results: list[StepResult]) -> list[int]:
    return [token for result in results for token in result.emitted]


def random_tree(rng: random.Random, budget: int, vocab: int, truth: list[int], shape: str) -> DraftTree:
    """A random tree of `budget` nodes that may contain a prefix of the true continuation."""
    planted = truth[: rng.randrange(0, min(len(truth), budget, 6) + 1)]
    tokens, parents, depths = [], [], []

    def add(token: int, parent: int) -> None:
        tokens.append(token)
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)

    previous = -1
    for token in planted:  # the true path first, so its nodes come before their random siblings
        add(token, previous)
        previous = len(tokens) - 1
    while len(tokens) < budget:
        if shape == "chain":
            parent = len(tokens) - 1
        elif shape == "wide":
            parent = -1
        else:
            parent = rng.randrange(-1, len(tokens))
        add(rng.randrange(vocab), parent)
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths))


class CausalAttention:
    """Plain causal attention over one sequence: the model run the way transformers runs it. MLA models need
    their config (`CausalAttention(config)`): the latent scale and value width are not in the shapes."""

    def __init__(self, config: ModelConfig | None = None):
        self.config = config

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
        return torch.einsum("hts,shd->thd", causal_softmax(scores), v)

    def latent(self, layer: int, q: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        if self.config is None or self.config.mla is None:
            raise ValueError("latent attention needs the MLA model's config: use CausalAttention(config)")
        scores = torch.einsum("thc,sc->hts", q, entries) * self.config.attention_scale
        return torch.einsum("hts,sr->thr", causal_softmax(scores), entries[:, :self.config.mla.kv_lora_rank])

    def kv_buffers(self, layer: int, num_tokens: int) -> None:
        return None

    def latent_rows(self, layer: int, num_tokens: int) -> None:
        return None

    def latent_expanded(self, *args) -> None:
        return None


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """scores: [H, T, T] of one sequence -> each query's softmax over itself and the tokens before it."""
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


causal_attention = CausalAttention()


def planted_trees(expected: list[int], seed: int = 0, min_depth: int = 0, max_depth: int = 6):
    """Draft trees holding the next `min_depth`..`max_depth` tokens of `expected` as one path (a drafter that is
    sometimes right), each true node after a wrong sibling, under the root and under every true node: the accepted
    rows are never the first ones, so whatever reads a wrong row shows."""
    rng = random.Random(seed)

    def next_tree(emitted: list[int]) -> DraftTree:
        tokens, parents, depths, parent = [], [], [], -1
        for depth, token in enumerate(expected[len(emitted):][:rng.randrange(min_depth, max_depth + 1)], start=1):
            tokens += [(token + 1) % 256, token]
            parents += [parent, parent]
            depths += [depth, depth]
            parent = len(tokens) - 1
        return DraftTree(tuple(tokens), tuple(parents), tuple(depths))
    return next_tree
