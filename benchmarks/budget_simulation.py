"""A batch of sessions stepping in lockstep against a synthetic engine, to judge budget policies by their outcome
(tokens per second) rather than by the budgets they pick.

The costs follow what the H200 and H100 runs of benchmarks/throughput.py measured: a step pays a fixed part, a part
per session, more per session that verifies a tree (its host work), and a little per row; drafts overlap each other,
and a pass that drafts at all waits for one draft round and pays the loop's own work for it. Trees are what the
n-gram drafter sends for periodic text: a chain the text may follow, then branches it never does (best-first, so a
smaller budget's tree is a prefix); or, for text that does not repeat, a few candidates for the next token, mostly
none, with one session in a few that repeats itself.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modeling.tree import DraftTree  # noqa: E402
from verifier_service.budget_planner import BudgetPlanner  # noqa: E402
from verifier_service.step_costs import BatchShape, StepCosts  # noqa: E402
from verifier_service.tree_budget import AdaptiveBudget, BudgetPolicy, FixedBudget, ServiceRecord  # noqa: E402

CONTEXT = 1024
DRAFT_S = 0.0003
CHAIN = 14  # the deepest chain the drafter proposes


@dataclass(frozen=True)
class Engine:
    """Seconds of a verify step: `fixed`, plus `per_session` for each session and `per_tree` more for each that
    verifies a tree, plus `per_row` for each row; each engine call costs `call_s` more (a burst of plain steps is one
    call); a pass that drafts waits for its draft round first: `round_s`, plus `round_per_draft` for each draft."""

    fixed: float = 0.0012
    per_session: float = 0.0002
    per_tree: float = 0.001
    per_row: float = 0.000005
    round_s: float = DRAFT_S
    round_per_draft: float = 0.0
    call_s: float = 0.0
    burst: int = 1  # plain steps per pass (verifier --decode-burst-steps)
    drafting_pass_host_s: float = 0.0  # the step loop's own work in a pass that drafts (requests, replies, trees)
    plain_host_s: float = 0.0  # the same per plain step of a burst

    def step_s(self, sessions: int, trees: int, rows: int) -> float:
        return self.fixed + self.per_session * sessions + self.per_tree * trees + self.per_row * rows

    def draft_round_s(self, drafts: int) -> float:
        return self.round_s + self.round_per_draft * drafts if drafts else 0.0


HOST_BOUND = Engine()  # as measured through the services: a session with a tree costs ~1 ms of host work
GPU_BOUND = Engine(per_tree=0.00005, per_row=0.00002)  # the engine step alone: trees cost their rows
# NOTE: the step loop on the H200, Qwen3-8B shape, 64 sessions (throughput_decode_bursts.md: a plain step took
# 12.35 ms one per call and 9.08 ms in calls of 4, so 8.0 ms a forward and 4.4 ms a call), ~23 us a tree row, a pass
# that drafts waits for its draft round with the GPU idle (drafter_hop.md: 0.65 ms for one draft, 2.3 ms for 16,
# 5.3 ms for 64), plain steps in bursts of 4
ROUND_BOUND = Engine(fixed=0.0029, per_session=0.00008, per_tree=0.0, per_row=0.000023, round_s=0.0005,
                     round_per_draft=0.00007, call_s=0.0044, burst=4)
# NOTE: the step loop on the H100, Qwen3-8B shape, 64 sessions at 1k (throughput_qwen3-8b.md, 2026-12-05, full
# window): a plain forward 11.7 ms on the GPU and 0.7 ms of host work, ~23 us a tree row, a draft round ~6 ms for 64
# n-gram drafts, the loop's own work ~4 ms in a pass that drafts (requests, replies, trees), plain steps in bursts of 4
PASS_BOUND = Engine(fixed=0.0117, per_session=0.0, per_tree=0.0, per_row=0.000023, round_s=0.0005,
                    round_per_draft=0.000083, call_s=0.0015, burst=4, drafting_pass_host_s=0.004,
                    plain_host_s=0.0002)
# NOTE: the same on the H100 for the Qwen3-0.6B shape (throughput_acceptance1_h100.md): a plain forward ~5 ms on the
# GPU and ~0.5 ms of host work, ~6 us a tree row, a draft round of ~4 ms for 64 n-gram drafts, the loop's own work
# ~2.3 ms in a pass that drafts: drafting costs a small model's batch more than its trees' rows
PASS_BOUND_SMALL = Engine(fixed=0.005, per_session=0.0, per_tree=0.0, per_row=0.000006, round_s=0.0005,
                          round_per_draft=0.00006, call_s=0.0008, burst=4, drafting_pass_host_s=0.0023,
                          plain_host_s=0.0005)
# NOTE: one or a few sessions at 128k, Qwen3-8B shape (e2e_step.md: a verify of 16 rows 9.7 ms, of 64 rows 17.5 ms, so
# ~0.16 ms a row: the rows' attention over the long prefix), an n-gram draft round of ~0.65 ms
LONG_CONTEXT = Engine(fixed=0.0072, per_session=0.0, per_tree=0.0, per_row=0.00016, round_s=0.0006,
                      round_per_draft=0.00005, call_s=0.0005, burst=4)


@dataclass(frozen=True)
class Workload:
    """What each generation's text lets a draft accept: nothing for its first `warmup` tokens (a model does not
    repeat itself at once), then up to `accept` nodes of the chain."""

    accept: int
    warmup: int = 0
    every: int = 1  # a draft accepts on one step in `every` only (acceptance ~1 + 1 / every for accept 1)
    # NOTE: the drafter proposes single tokens, no chains (an n-gram trie on text that does not repeat: candidates
    # for the next token only), and the one that matches on a lucky step is the k-th best, k cycling through RANKS
    siblings: bool = False
    found: int = 1  # the drafter proposes anything on one unlucky step in `found` only (an empty tree otherwise)
    looping: int = 0  # one session in `looping` repeats itself instead (its drafts accept their whole chain)
    # NOTE: the lucky steps fall on text positions drawn at random (one in `every`) rather than on every `every`-th:
    # a random model's text repeats itself in places, and which places does not depend on the budgets a policy took
    scattered: bool = False
    seed: int = 0  # which random steps, where `scattered`

    @property
    def trees(self) -> str:
        """The table's words for its trees."""
        kind = f"candidates, found on 1 step in {self.found}" if self.siblings else "chains"
        kind += ", on random steps" if self.scattered else ""
        return kind + (f"; 1 session in {self.looping} loops" if self.looping else "")

    def lucky(self, made: int, session: int, generation: int = 0) -> bool:
        """Whether a step `made` tokens into the session's `generation`-th generation may accept (`path`)."""
        if self.scattered:  # NOTE: each generation its own text: other places repeat
            draw = random.Random(((self.seed * 1009 + generation) * 65537 + made) * 7919 + session)
            return draw.random() < 1 / self.every
        return (made + session) % self.every == 0

    def of_session(self, session: int) -> Workload:
        return Workload(CHAIN) if self.looping and session % self.looping == self.looping - 1 else self

    def tree(self, budget: int, step: int, lucky: bool) -> DraftTree:
        if not lucky and step % self.found:
            return DraftTree.empty()
        return DraftTree(tuple(range(budget)), (-1,) * budget, (1,) * budget) if self.siblings else draft(budget)

    def path(self, tree: DraftTree, step: int, lucky: bool) -> list[int]:
        """The nodes of `tree` accepted at a generation's step `step`."""
        if step < self.warmup or not lucky:
            return []
        if self.siblings:
            rank = RANKS[step % len(RANKS)]
            return [rank] if rank < len(tree) else []
        return list(range(min(self.accept, len(tree), CHAIN)))  # the chain's first nodes


RANKS = (0, 2, 1, 5, 0, 9, 3, 1, 12, 0)


def draft(budget: int) -> DraftTree:
    chain = min(budget, CHAIN)
    parents = tuple(range(-1, chain - 1)) + (-1,) * (budget - chain)
    depths = tuple(range(1, chain + 1)) + (1,) * (budget - chain)
    return DraftTree(tuple(range(budget)), parents, depths)


def adaptive_sessions(max_budget: int = 63) -> Callable[[StepCosts], BudgetPolicy]:
    """New adaptive sessions of one service: they share its record of what each budget accepts."""
    shared = ServiceRecord()
    return lambda costs: AdaptiveBudget(max_budget, costs, shared)


def tokens_per_s(new_policy: Callable[[StepCosts], BudgetPolicy], sessions: int, workload: Workload,
                 engine: Engine = HOST_BOUND, tokens: int = 128, generations: int = 4) -> float:
    """Every session runs `generations` generations of `tokens` tokens back to back (a new policy each, as a
    one-shot request gets; the first generations are shorter, so that the sessions' generations start at different
    passes, as requests arrive); all sessions step together, in passes as the step loop runs them: the tree step, then
    with `engine.burst` > 1 a burst of plain steps when no draft was accepted and a session past its first step
    stepped plainly. Tokens per simulated second."""
    costs = StepCosts()
    planner = BudgetPlanner(costs)
    policies = [new_policy(costs) for _ in range(sessions)]
    made, finished, elapsed, total = [0] * sessions, [0] * sessions, 0.0, 0
    lengths = [tokens - i * tokens // (2 * sessions) for i in range(sessions)]

    def emit(i: int, count: int) -> None:
        nonlocal total
        made[i] += count
        total += count
        if made[i] >= lengths[i]:
            made[i], finished[i], policies[i], lengths[i] = 0, finished[i] + 1, new_policy(costs), tokens

    planned_ahead: frozenset | None = None
    while min(finished) < generations:
        stepping = [i for i in range(sessions) if made[i]]  # NOTE: a generation's first step is plain, as the loop's
        budgets = [0] * sessions
        generations_in = frozenset((i, finished[i]) for i in stepping)  # NOTE: as the loop's session ids
        ahead, planned_ahead = planned_ahead, None
        if not (ahead is not None and generations_in <= ahead or planner.holds(generations_in)):
            offers = [policies[i].offer(CONTEXT) for i in stepping]
            planned = planner.plan(offers, CONTEXT, besides=sessions - len(stepping), sessions=generations_in)
            for i, budget in zip(stepping, planned):
                budgets[i] = budget
        plain = engine.step_s(sessions, 0, sessions)
        if engine.burst > 1 and len(stepping) == sessions and not any(budgets):  # NOTE: one call, a burst
            # NOTE: while it runs, the loop plans the next pass where that would plan, from these records
            # (StepLoop._plan_ahead); a plan in which someone drafts is left to that pass
            if planner.plans_ahead(generations_in) and planner.plan_plain(
                    [policies[i].offer(CONTEXT) for i in stepping], CONTEXT, sessions=generations_in):
                planned_ahead = generations_in
            elapsed += engine.call_s + engine.burst * (plain + engine.plain_host_s)
            costs.observe_batch(BatchShape(sessions, sessions), CONTEXT, engine.call_s / engine.burst + plain)
            costs.observe_pass_host(False, engine.plain_host_s)
            for _ in range(engine.burst):
                for i, policy in enumerate(policies):
                    policy.observe(0, None, [])
                    emit(i, 1)
            continue
        texts = [workload.of_session(i) for i in range(sessions)]
        lucky = [texts[i].lucky(made[i], i, finished[i]) for i in range(sessions)]
        trees = [texts[i].tree(budget, made[i], lucky[i]) if budget else DraftTree.empty()
                 for i, budget in enumerate(budgets)]
        batch = BatchShape(sessions, sum(len(tree) + 1 for tree in trees))
        verify = engine.call_s + engine.step_s(sessions, sum(1 for tree in trees if len(tree)), batch.rows)
        round_s = engine.draft_round_s(sum(1 for budget in budgets if budget))
        host_s = engine.drafting_pass_host_s if round_s else engine.plain_host_s
        elapsed += verify + round_s + host_s
        costs.observe_batch(batch, CONTEXT, verify)
        costs.observe_pass_host(bool(round_s), host_s)
        accepted_any = False
        for i, (policy, budget, tree) in enumerate(zip(policies, budgets, trees)):
            if budget:
                costs.observe_draft(budget, CONTEXT, round_s)
            path = texts[i].path(tree, made[i], lucky[i])
            accepted_any |= bool(path)
            policy.observe(budget, tree, path)
            emit(i, 1 + len(path))
        # NOTE: the rest of the pass in one call, where a session stepped plainly (as in the loop, a generation's
        # first step does not count: StepLoop._verify)
        if engine.burst > 1 and not accepted_any and any(budgets[i] == 0 for i in stepping):
            elapsed += engine.call_s + (engine.burst - 1) * plain
            costs.observe_batch(BatchShape(sessions, sessions), CONTEXT, engine.call_s / (engine.burst - 1) + plain)
            for _ in range(engine.burst - 1):
                for i, policy in enumerate(policies):
                    policy.observe(0, None, [])
                    emit(i, 1)
    return total / elapsed


WORKLOADS = (Workload(13, 8), Workload(13), Workload(0), Workload(1), Workload(3), Workload(6), Workload(13, 40),
             Workload(1, every=20), Workload(3, every=8),  # drafts that seldom pay (acceptance ~1.05)
             # NOTE: the next token's candidates, mostly none, the right one on one step in 33 (random weights, n-gram
             # drafts), and the same with one session in 8 (or 16) repeating itself
             Workload(1, every=33, siblings=True, found=4), Workload(1, every=33, siblings=True, found=4, looping=8),
             Workload(1, every=33, siblings=True, found=4, looping=16),
             # NOTE: text that repeats in scattered places: a draft's chain accepted on one step in 2 or 3, at random
             Workload(6, every=2, scattered=True), Workload(13, every=3, scattered=True))
FIXED = (0, 7, 15, 31, 63)
ENGINES = {"host-bound": HOST_BOUND, "gpu-bound": GPU_BOUND, "round-bound": ROUND_BOUND, "pass-bound": PASS_BOUND,
           "pass-bound 0.6B": PASS_BOUND_SMALL, "long-context": LONG_CONTEXT}
LONG_CONTEXT_SESSIONS = [1, 4]  # NOTE: a few sessions at 128k fill a GPU's KV


def main() -> None:
    """The adaptive policy against every fixed budget over the grid of engines, workloads and batch sizes."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 64],
                        help="batch sizes of the batch engines (the long-context one runs 1 and 4 sessions)")
    parser.add_argument("--seeds", type=int, default=12, help="draws of the random steps a lone session's texts "
                        "repeat on, for the table of their means (one such text is mostly luck)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = []
    for name, engine in ENGINES.items():
        for workload in WORKLOADS:
            for sessions in LONG_CONTEXT_SESSIONS if engine is LONG_CONTEXT else args.sessions:
                fixed = {b: tokens_per_s(lambda _, b=b: FixedBudget(b), sessions, workload, engine) for b in FIXED}
                adaptive = tokens_per_s(adaptive_sessions(), sessions, workload, engine)
                rows.append({"engine": name, "accept": workload.accept, "warmup": workload.warmup,
                             "every": workload.every, "trees": workload.trees,
                             "sessions": sessions, "fixed": fixed, "adaptive": adaptive,
                             "vs_best": adaptive / max(fixed.values())})
                print(rows[-1], flush=True)
    drawn = lone_sessions_over_seeds(args.seeds)
    command = " ".join(["python benchmarks/budget_simulation.py", *sys.argv[1:]])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "budget_simulation.json").write_text(json.dumps({"command": command, "rows": rows,
                                                                     "random_steps_alone": drawn}, indent=1))
    lines = ["# The adaptive tree budget on simulated batches", "", f"Command: `{command}`", "",
             "Tokens per simulated second (`benchmarks/budget_simulation.py`: sessions stepping together, their "
             "generations staggered, n-gram-like trees, step costs from the H200 and H100 runs); 'vs best' = "
             "adaptive / the best of the fixed budgets (0 = plain).", "",
             "| engine | trees | accepts | after tokens | on one step in | sessions | "
             + " | ".join(f"fixed {b}" for b in FIXED) + " | adaptive | vs best |", "|---" * (8 + len(FIXED)) + "|"]
    lines += [f"| {r['engine']} | {r['trees']} | {r['accept']} | {r['warmup']} | {r['every']} | {r['sessions']} | "
              + " | ".join(f"{r['fixed'][b]:.0f}" for b in FIXED) + f" | {r['adaptive']:.0f} | {r['vs_best']:.2f} |"
              for r in rows]
    lines += ["", f"## Texts that repeat on random steps, a lone session, {args.seeds} draws of the steps", "",
              "adaptive / the best fixed budget of each draw: mean, min, and the draws below 0.95.", "",
              "| engine | accepts | on one step in | mean | min | below 0.95 |", "|---" * 6 + "|"]
    lines += [f"| {r['engine']} | {r['accept']} | {r['every']} | {sum(r['vs_best']) / len(r['vs_best']):.2f} | "
              f"{min(r['vs_best']):.2f} | {sum(v < 0.95 for v in r['vs_best'])} / {len(r['vs_best'])} |" for r in drawn]
    (args.out_dir / "budget_simulation.md").write_text("\n".join(lines) + "\n")


def lone_sessions_over_seeds(seeds: int) -> list[dict]:
    """A lone session's adaptive / best fixed on texts that repeat on random steps, per engine and text, for each of
    `seeds` draws of those steps."""
    rows = []
    for name, engine in ENGINES.items():
        for workload in (w for w in WORKLOADS if w.scattered):
            ratios = []
            for seed in range(seeds):
                drawn = replace(workload, seed=seed)
                best = max(tokens_per_s(lambda _, b=b: FixedBudget(b), 1, drawn, engine) for b in FIXED)
                ratios.append(tokens_per_s(adaptive_sessions(), 1, drawn, engine) / best)
            rows.append({"engine": name, "accept": workload.accept, "every": workload.every, "vs_best": ratios})
    return rows


if __name__ == "__main__":
    main()
