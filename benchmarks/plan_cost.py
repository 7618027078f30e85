"""The step loop's planning work per pass where drafts seldom pay (acceptance ~1): every session asked for its offer
and the batch planned at every pass, against the loop's way (an all-plain plan stands for up to HOLD_PASSES passes of
the same sessions, `BudgetPlanner.holds`). Host work only, no engine: on the H200 at 64 sessions of the 0.6B shape a
plain step of an adaptive run cost 0.78 ms of host against 0.42 without a drafter (throughput_decode_bursts.md).

Each session's drafts fail (its probes' trees match nothing); the service's cost models hold what an H200 measured
for that run (a 4.5 ms plain step, a 2 ms draft round, 2 ms of host work a drafting pass). Both arms run the same
passes after the same warm-up, so they probe alike; the table says how many passes drafted in each.

    python benchmarks/plan_cost.py [--sessions 16 64 128] [--passes 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_step import git_commit, write_results  # noqa: E402
from modeling.tree import DraftTree  # noqa: E402
from verifier_service.budget_planner import HOLD_PASSES, BudgetPlanner  # noqa: E402
from verifier_service.step_costs import BatchShape, StepCosts  # noqa: E402
from verifier_service.tree_budget import AdaptiveBudget, ServiceRecord  # noqa: E402

CONTEXT = 1500
MAX_BUDGET = 15
WARM_UP_PASSES = 300


def measured_costs(sessions: int) -> StepCosts:
    costs = StepCosts()
    for rows in (sessions, 2 * sessions, 4 * sessions):
        costs.observe_batch(BatchShape(sessions, rows), CONTEXT, 0.0045 + rows * 1e-5)
    costs.observe_draft(3, CONTEXT, 0.002)
    costs.observe_batch(BatchShape(sessions, sessions), CONTEXT, 0.0045)
    costs.observe_pass_host(True, 0.002)
    costs.observe_pass_host(False, 0.0004)
    return costs


def pass_cost(sessions: int, passes: int, hold: bool) -> dict:
    """Seconds of planning a pass (mean), the passes planned and the passes that drafted, over `passes` passes of
    `sessions` sessions whose drafts all fail, after a warm-up in which they learnt so."""
    costs = measured_costs(sessions)
    shared = ServiceRecord()
    policies = [AdaptiveBudget(MAX_BUDGET, costs, shared) for _ in range(sessions)]
    planner, names = BudgetPlanner(costs), frozenset(range(sessions))

    def observe(budgets: list[int]) -> None:
        for policy, budget in zip(policies, budgets):
            policy.observe(budget, DraftTree.chain([5] * budget) if budget else None, [])

    for _ in range(WARM_UP_PASSES):
        observe(planner.plan([policy.offer(CONTEXT) for policy in policies], CONTEXT, sessions=names))
    planned = drafted = 0
    seconds = 0.0
    for _ in range(passes):
        started = time.perf_counter()
        if hold and planner.holds(names):
            seconds += time.perf_counter() - started
            observe([0] * sessions)
            continue
        budgets = planner.plan([policy.offer(CONTEXT) for policy in policies], CONTEXT, sessions=names)
        seconds += time.perf_counter() - started
        planned, drafted = planned + 1, drafted + any(budgets)
        observe(budgets)
    return {"sessions": sessions, "hold": hold, "ms_per_pass": 1e3 * seconds / passes, "planned": planned,
            "drafting_passes": drafted, "passes": passes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--passes", type=int, default=2000)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = [pass_cost(sessions, args.passes, hold) for sessions in args.sessions for hold in (False, True)]
    command = "python benchmarks/plan_cost.py " + " ".join(sys.argv[1:])
    lines = [f"# The step loop's planning work per pass at acceptance ~1 (CPU, commit {git_commit()})", "",
             f"`{command.strip()}`", "",
             "| sessions | plan | ms a pass | passes planned | passes that drafted |", "|---|---|---|---|---|"]
    for row in rows:
        plan = f"holds up to {HOLD_PASSES} passes" if row["hold"] else "every pass"
        lines.append(f"| {row['sessions']} | {plan} | {row['ms_per_pass']:.3f} | {row['planned']} of {row['passes']} "
                     f"| {row['drafting_passes']} |")
    write_results(args.out_dir, "plan_cost", {"command": command.strip(), "commit": git_commit(), "rows": rows},
                  "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
