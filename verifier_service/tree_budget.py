"""The tree budget of each step: fixed, pinned by the request, or adaptive (docs/design.md section 4, "The budget
of a step").

An adaptive session offers its batch's plan (verifier_service/budget_planner.py), per candidate budget b in
{0, 1, 3, 7, ..., max}, the nodes it expects accepted and the nodes it expects its tree to have. What a budget
accepts comes from the session's own steps. Both drafters build best-first trees: the tree of budget b is the first
b nodes of the tree of any budget B >= b (DDTree pops nodes from a heap in a total order, the n-gram trie sorts its
nodes once and keeps a prefix; tests/test_tree_budget.py checks both). The walk takes the first child that matches,
so a step verified with budget B and accepted path p would have accepted, with budget b, the longest prefix of p
whose nodes are all below b: one verify tells every smaller budget's outcome (exactly when greedy; when sampling,
the same draws per node make it an unbiased estimate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from modeling.tree import DraftTree
from verifier_service.errors import InvalidArgument
from verifier_service.step_costs import DecayedMean, StepCosts

BudgetPolicyName = Literal["fixed", "adaptive"]
BUDGET_POLICIES: tuple[BudgetPolicyName, ...] = ("fixed", "adaptive")
SHARED_DECAY = 0.99  # what the service's sessions' trees accepted: about their last hundred steps
# NOTE: what an empty draft weighs against a tree that failed: it says the drafter has nothing yet (the text has not
# repeated itself so far), which the next tokens may change, and costs only the draft's round trip to find out
EMPTY_WEIGHT = 0.25
# NOTE: what a tree none of whose nodes matched tells of the larger budgets (their further nodes are the less likely
# ones): a warm-up no longer walks through every larger size, failing at each (budget_simulation.md)
FAILED_BELOW_WEIGHT = 0.5
RATIO_STEPS_CAP = 64  # the most steps one draft's `relative` ratio stands for in the service's usual ratio


def candidate_budgets(max_budget: int) -> tuple[int, ...]:
    """0 (no draft), then 2^k - 1 below the maximum, then the maximum: with the root, 2^k verify rows, one per
    token bucket."""
    powers = [(1 << k) - 1 for k in range(1, max_budget.bit_length() + 1) if (1 << k) - 1 < max_budget]
    return (0, *powers, max_budget) if max_budget > 0 else (0,)


def accepted_within(path: list[int], budget: int) -> int:
    """What a budget-`budget` prefix of the same best-first tree would have accepted: the longest prefix of the
    path whose nodes are all below `budget`."""
    return next((i for i, node in enumerate(path) if node >= budget), len(path))


def outcomes(candidates: tuple[int, ...], budget: int, tree: DraftTree,
             path: list[int]) -> list[tuple[int, int, int]]:
    """(b, accepted nodes, tree nodes) that each candidate b in 1..`budget` would have had with the same best-first
    tree cut to b, given the accepted `path` (node indices) of the tree verified."""
    return [(b, accepted_within(path, b), min(b, len(tree))) for b in candidates[1:] if b <= budget]


class Offer(NamedTuple):
    """What a session brings to its batch's plan: the budget it must have (`pinned`), or, per candidate budget,
    the nodes it expects accepted and the nodes it expects its tree to have."""

    pinned: int | None
    candidates: tuple[int, ...] = ()
    accepted: tuple[float, ...] = ()
    nodes: tuple[float, ...] = ()
    idle: int = 0  # its steps since it last drafted
    context: int = 0  # its KV length: what its tree's rows cost (0: as any other session's)
    wanted: int = 0  # the budget it asks for in a pass that drafts at all (0: none)


class BudgetPolicy(Protocol):
    def offer(self, context: int) -> Offer:
        """What the next step of a session whose KV holds `context` tokens brings to the batch's plan."""

    def observe(self, budget: int, tree: DraftTree | None, path: list[int]) -> None:
        """A step ran with `budget`: `tree` verified (None when none came), `path` its accepted nodes."""

    def observe_plain(self, steps: int) -> None:
        """`steps` plain steps ran in a row (a decode burst's): what as many `observe(0, None, [])` record."""


class Outcomes:
    """Per candidate budget, decayed means of the nodes its tree would have accepted and of the nodes it had."""

    def __init__(self, decay: float):
        self.decay = decay
        self.records: dict[int, list[float]] = {}  # budget -> [accepted total, nodes total, weight], decayed

    def __contains__(self, budget: int) -> bool:
        return budget in self.records

    def add(self, budget: int, accepted: int, nodes: int, weight: float = 1.0) -> None:
        record = self.records.get(budget)
        if record is None:
            record = self.records[budget] = [0.0, 0.0, 0.0]
        decay = self.decay
        record[0] = decay * record[0] + weight * accepted
        record[1] = decay * record[1] + weight * nodes
        record[2] = decay * record[2] + weight

    def mean(self, budget: int) -> tuple[float, float]:
        accepted, nodes, weight = self.records[budget]
        return accepted / weight, nodes / weight

    def weight(self, budget: int) -> float:
        return self.records[budget][2]

    def forget(self, budget: int) -> None:
        self.records.pop(budget, None)


class ServiceRecord(Outcomes):
    """What all the service's sessions' trees accepted (decayed over about their last hundred steps), and how a
    session's trees usually fare against that record."""

    def __init__(self, decay: float = SHARED_DECAY):
        super().__init__(decay)
        self.ratios = DecayedMean(decay)  # the sessions' own ratios as they drafted, each weighted by its steps since

    def add_ratio(self, ratio: float, steps: float) -> None:
        self.ratios.add(ratio, steps)

    def usual_ratio(self) -> float:
        """What a session's trees accept over this record, per session-step (1 before any): low where most sessions'
        drafts fail while a few sessions write the record."""
        return self.ratios.value if self.ratios.weight else 1.0


@dataclass(frozen=True)
class FixedBudget:
    """One budget every step. With `shared` (a pinned request in a service of adaptive sessions), its trees still
    teach the service's record what each smaller budget would have accepted."""

    budget: int
    shared: ServiceRecord | None = field(default=None, compare=False)
    candidates: tuple[int, ...] = field(default=(), compare=False)  # the service's: what `shared` is kept for

    def offer(self, context: int) -> Offer:
        return Offer(self.budget)

    def observe(self, budget: int, tree: DraftTree | None, path: list[int]) -> None:
        if self.shared is not None and tree is not None and budget:
            for outcome in outcomes(self.candidates, budget, tree, path):
                self.shared.add(*outcome)

    def observe_plain(self, steps: int) -> None:
        pass


class AdaptiveBudget:
    """One session's offers to its batch's plan: per candidate budget, what it expects accepted.

    What a budget accepts comes from the session's own steps, and until it has verified one of that size, from
    `shared`, the record of all the service's sessions (so a new session does not pay to explore what the others
    know), or, before any session has, from hope (every node accepted). A record weighs less the longer it goes
    unverified (by `age_decay` a step) against what the service's sessions accept (weight `hope` over the sessions
    of the batch: a session stepping alone wrote that record itself, over its earlier generations, and one of 64
    mostly did not; budget_simulation.md, texts that repeat on random steps): where the others'
    drafts pay, a session whose first drafts failed (a model seldom repeats itself from its first token) comes back
    within a few steps; where nobody's do, the planner's probes bring it back. The service's record counts for as
    much as the session's trees have kept up with it where both have records (`relative`). Its tree is taken at its
    full size meanwhile. A tree none of whose nodes matched also counts, at FAILED_BELOW_WEIGHT, as a failure of the
    larger budgets.

    An empty draft (the drafter found nothing to propose) counts as a failure only when the one before was empty too,
    and then as a quarter of one.
    Two ways up: a path that ran into the tree's edge (it ended at a leaf of a tree the budget had cut) drops the
    larger budgets' records that expect fewer nodes than it accepted, and asks for the next candidate up
    (`Offer.wanted`), unless that one was verified lately, which the session gets in the next pass that drafts at
    all (or once most of the batch asks); and after two paying steps in a row, the maximum is verified again (its
    offer pins it). Both only as often as keeps those explorations under `explore_share` of the batch's time (all
    its sessions' explorations together)."""

    def __init__(self, max_budget: int, costs: StepCosts, shared: ServiceRecord, explore_share: float = 0.02,
                 decay: float = 0.8, age_decay: float = 0.8, hope: float = 3.0):
        self.max_budget, self.costs, self.shared = max_budget, costs, shared
        self.explore_share, self.age_decay, self.hope = explore_share, age_decay, hope
        self.candidates = candidate_budgets(max_budget)
        self.own = Outcomes(decay)
        self.steps = 0
        self.verified_at: dict[int, int] = {}  # budget > 0 -> the step that last told its outcome
        self.since_max = 0  # steps since the last one at the maximum, that one included
        self.step_up: int | None = None  # the size it asks for after a path that ran into the edge, until it drafts
        self.last_budget = 0  # this session's budget in its last step
        self.paying = 0  # its last steps in a row whose drafts were accepted
        self.drafted_at = 0  # the last step with a draft
        self.last_rows = 1  # this session's rows in its last step
        self.forgive_empty = True  # an empty draft is taken as a failure only after one that was empty too

    def offer(self, context: int) -> Offer:
        if (self.step_up is None and self.paying >= 2 and self.last_budget < self.max_budget
                and self._exploration_due(context, self.max_budget, self.since_max)):
            return Offer(self.max_budget)
        relative = self.relative()
        expected = [self.expected(budget, relative) for budget in self.candidates]
        wanted = self.step_up or 0
        if wanted and not self._exploration_due(context, wanted, self.steps - self.verified_at.get(wanted, -10**9)):
            wanted = 0
        return Offer(None, self.candidates, tuple(e[0] for e in expected), tuple(e[1] for e in expected),
                     self.steps - self.drafted_at, context, wanted)

    def relative(self) -> float:
        """What this session's trees accept over what the service's do (`own_ratio`), aged like a record towards
        what the service's sessions' trees usually accept over that record (`ServiceRecord.usual_ratio`): what the
        session expects of the service's record at the budgets it has not verified lately. The sessions whose drafts
        pay write most of that record (they draft at every step and climb to the large trees): in a batch where one
        session repeats itself, the others, just probed in vain at 3, expected their trees of 7 and 15 to accept
        what its did, and joined its next passes at those sizes (budget_simulation.md; on the H100, 8B shape, 64
        sessions: 0.90x plain). Aged towards 1, every idle session of a batch came back to the record within ~10
        bursts, and the plan drafted them all at 15, in vain, every 11-17 passes (H100, Qwen3-0.6B shape, 64
        sessions, acceptance ~1.1: 0.92x plain); aged towards the usual ratio, a session returns to the record where
        most sessions' drafts pay (one that failed in its warm-up) and stays low where a few sessions write it."""
        own = self.own_ratio()
        if own is None:
            return 1.0
        budget, ratio = own
        weight = self.own.weight(budget) * self.age_decay ** (self.steps - self.verified_at[budget])
        hope = self.service_weight()
        return (weight * ratio + hope * self.shared.usual_ratio()) / (weight + hope)

    def service_weight(self) -> float:
        """What the service's record weighs against the session's own, in its steps: `hope` when the session steps
        alone, less the more sessions write that record beside it. Alone, a weight of 0.01 let one failed draft
        (or three) stop its drafts for tens of steps on text whose repeats fall on random steps (budget_simulation.md,
        one session, 13-node chains on one step in 3: 0.28-0.56x the best fixed budget, now 0.28-0.73x; 6-node chains
        on one step in 2: 0.71-0.89x, now 0.72-0.89x); 3 in batches too cost the batches in which one session in 8
        loops (1.31x -> 1.03x in batches of 64), 3 over the batch's sessions nothing there."""
        return self.hope / max(1, self.costs.batch.sessions)

    def own_ratio(self) -> tuple[int, float] | None:
        """(budget, ratio): what this session's trees accepted over the service's record, at the smallest budget
        both have records of (at most 1; 1 where the record accepts nothing), None before it has one."""
        for budget in self.candidates[1:]:
            if budget in self.own and budget in self.shared:
                usual = self.shared.mean(budget)[0]
                return budget, min(1.0, self.own.mean(budget)[0] / usual) if usual > 0 else 1.0
        return None

    def expected(self, budget: int, relative: float = 1.0) -> tuple[float, float]:
        """(accepted nodes, tree nodes) a step of `budget` can expect: the record, aged, blended with what the
        service's sessions accept (times `relative`) and the budget's full size."""
        if budget == 0:
            return 0.0, 0.0
        if budget in self.own:
            record, weight = self.own.mean(budget), self.own.weight(budget)
            age = self.steps - self.verified_at[budget]
        elif budget in self.shared:  # NOTE: as one step of the session's own, taken when it began
            accepted, nodes = self.shared.mean(budget)
            record, weight, age = (relative * accepted, nodes), 1.0, self.steps
        else:
            return float(budget), float(budget)
        weight *= self.age_decay ** age
        usual = relative * self.shared.mean(budget)[0] if budget in self.shared else budget
        hope = self.service_weight()
        return ((weight * record[0] + hope * usual) / (weight + hope),
                (weight * record[1] + hope * budget) / (weight + hope))

    def _exploration_due(self, context: int, budget: int, since: int) -> bool:
        """Whether `since` steps since `budget` last told its outcome are enough that one more step at it spends at
        most `explore_share` of the batch's time on the explorations of all its sessions (each one adds its tree's
        rows to the batch as it stands, and its draft round if the batch had none): the maximum after paying steps,
        and a step up. A step up on every path that ended at a leaf of a cut tree (n-gram trees are wide: most
        paths do) cost a lone session at 128k a tree of 31 rows for every such path of 15 (budget_replay_edits.md,
        edits below 0.95 of the best fixed budget without this check / with it: long-context engine 9 / 8 of 24,
        GPU-bound 9 / 6)."""
        besides = max(0, self.costs.batch.rows - self.last_rows)
        usual = self.costs.seconds(self.last_budget, self.expected(self.last_budget)[1], context, besides)
        explored = self.costs.seconds(budget, self.expected(budget)[1], context, besides)
        return since >= self.costs.batch.sessions * (explored - usual) / (self.explore_share * usual)

    def observe_plain(self, steps: int) -> None:
        """A burst's plain steps in one call rather than one per token."""
        if steps > 0:
            self.steps += steps
            self.since_max += steps
            self.last_budget, self.paying, self.last_rows = 0, 0, 1

    def observe(self, budget: int, tree: DraftTree | None, path: list[int]) -> None:
        self.steps += 1
        self.since_max += 1
        self.last_budget = budget
        self.paying = self.paying + 1 if path else 0
        self.last_rows = (len(tree) if tree else 0) + 1
        if tree is None or budget == 0:  # NOTE: a step up it asked for waits for the next pass that drafts
            return
        idle, self.drafted_at = self.steps - self.drafted_at, self.steps
        self.step_up = None
        weight = 1.0
        if not len(tree):  # NOTE: the drafter found nothing to propose; once is no sign that its trees would fail
            forgiven, self.forgive_empty = self.forgive_empty, False
            if forgiven:
                return
            weight = EMPTY_WEIGHT
        else:
            self.forgive_empty = True
        if budget == self.max_budget:
            self.since_max = 1
        for outcome in outcomes(self.candidates, budget, tree, path):
            self.own.add(*outcome, weight)
            self.shared.add(*outcome, weight)
            self.verified_at[outcome[0]] = self.steps
        own = self.own_ratio()
        if own is not None:  # NOTE: a session idle for long stands for that many steps of the service, up to a cap
            self.shared.add_ratio(own[1], min(idle, RATIO_STEPS_CAP))
        if not path:  # NOTE: none of its best nodes matched: the larger trees' further nodes are likelier to fail too
            for larger in (b for b in self.candidates if b > budget):
                self.own.add(larger, 0, larger, weight * FAILED_BELOW_WEIGHT)
                self.verified_at.setdefault(larger, self.steps)
        if len(tree) == budget and path and path[-1] not in tree.parents:
            # NOTE: a larger best-first tree holds this one, so it would have accepted as much: records that expect
            # less (failures from before the text repeated) are stale, and the service's record answers again
            for larger in (b for b in self.candidates if b > budget):
                if larger in self.own and self.own.mean(larger)[0] < len(path):
                    self.own.forget(larger)
                    self.verified_at.pop(larger)
            larger = next((b for b in self.candidates if b > budget), None)
            if larger is not None and (larger not in self.own or self.own.weight(larger) * self.age_decay ** (
                    self.steps - self.verified_at[larger]) < 1):  # NOTE: a recent verify already told what it accepts
                self.step_up = larger


def session_policy(policy: BudgetPolicyName, max_budget: int, pinned: int, costs: StepCosts,
                   shared: ServiceRecord) -> BudgetPolicy:
    """A generation's policy: the request's `tree_budget` when it pins one (> 0), else the server's."""
    if pinned < 0:
        raise InvalidArgument(f"tree_budget: {pinned} is negative (0 = the server's policy)")
    if pinned > max_budget:
        raise InvalidArgument(f"tree_budget: {pinned} is more than the server's maximum {max_budget}")
    if policy == "fixed":
        return FixedBudget(pinned or max_budget)
    if pinned:  # NOTE: its trees still tell the adaptive sessions what the budgets accept
        return FixedBudget(pinned, shared, candidate_budgets(max_budget))
    return AdaptiveBudget(max_budget, costs, shared)
