"""The tree budget of each step: fixed, pinned by the request, or adaptive (docs/design.md section 4, "The budget
of a step").

The adaptive policy picks, each step, the candidate budget b in {0, 1, 3, 7, ..., max} with the most expected
committed tokens per second of a batch of N sessions like it (N: the last batch's sessions),
E[tokens(b)] / (t_draft(b) + t_verify(N x (b + 1) rows)):

- E[tokens(b)] comes from the session's own steps. Both drafters build best-first trees: the tree of budget b is
  the first b nodes of the tree of any budget B >= b (DDTree pops nodes from a heap in a total order, the n-gram
  trie sorts its nodes once and keeps a prefix; tests/test_tree_budget.py checks both). The walk takes the first
  child that matches, so a step verified with budget B and accepted path p would have accepted, with budget b, the
  longest prefix of p whose nodes are all below b: one verify tells every smaller budget's outcome (exactly when
  greedy; when sampling, the same draws per node make it an unbiased estimate).
- The seconds come from CostModels shared by the service's sessions, learnt from measured step times; a verify
  is keyed by the whole batch's rows, so a session in a batch of N weighs its tree as N such trees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from modeling.tree import DraftTree
from verifier_service.errors import InvalidArgument

BudgetPolicyName = Literal["fixed", "adaptive"]
BUDGET_POLICIES: tuple[BudgetPolicyName, ...] = ("fixed", "adaptive")
SHARED_DECAY = 0.99  # what the service's sessions' trees accepted: about their last hundred steps
# NOTE: a record out of date drifts to at least this share of its tree accepted: sessions that start together all
# fail their first drafts (the model does not repeat itself yet), and the shared record alone would then keep them
# from drafting when their texts turn predictable (benchmarks/results/budget_simulation.md)
HOPE_SHARE = 0.2
# NOTE: what an empty draft weighs against a tree that failed: it says the drafter has nothing yet (the text has not
# repeated itself so far), which the next tokens may change, and costs only the draft's round trip to find out
EMPTY_WEIGHT = 0.25


def bucket(n: float) -> int:
    """The power of two at or above n (1 for n <= 1): step times are kept per bucket, not per exact size."""
    return 1 << (max(1, math.ceil(n)) - 1).bit_length()


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


@dataclass
class DecayedMean:
    """A mean in which each value weighs `decay` times the next one: it follows a drifting quantity and, unlike an
    exponential average started at its first value, does not let that one stand for several."""

    decay: float
    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float) -> None:
        self.total = self.decay * self.total + value
        self.weight = self.decay * self.weight + 1

    @property
    def value(self) -> float:
        return self.total / self.weight


class CostModel:
    """Seconds of one part of a step (a verify of T rows, a draft of b nodes), learnt online per (size bucket,
    context bucket) as a decayed mean of measured times.

    A size with no measurement at its context is interpolated between the measured sizes around it. Past the largest
    measured size it costs what that one did, until tried: an estimate that guessed larger batches dear (a prior, or
    a line through two small sizes) kept every session from ever trying one. Below the smallest it follows the line
    through the two smallest, no cheaper than the smallest, or with one measured size the prior's shape, seconds =
    prior_s * (1 + slope * size). With no measurement at all the prior answers. A context with no measurement
    borrows the nearest measured context's row. Why buckets: sizes and contexts vary step by step, powers of two
    keep a handful of cells, each one measured often; why a decayed mean: the costs move with the load (other
    sessions share the batch)."""

    def __init__(self, prior_s: float, slope: float, decay: float = 0.9):
        self.prior_s, self.slope, self.decay = prior_s, slope, decay
        self.rows: dict[int, dict[int, DecayedMean]] = {}  # context bucket -> size bucket -> seconds
        self.memo: dict[tuple[int, int], float] = {}  # (size bucket, context bucket) -> seconds, until an observe

    def prior(self, size: float) -> float:
        return self.prior_s * self._shape(size)

    def _shape(self, size: float) -> float:
        return 1 + self.slope * size

    def observe(self, size: float, context: int, seconds: float) -> None:
        self.rows.setdefault(bucket(context), {}).setdefault(bucket(size), DecayedMean(self.decay)).add(seconds)
        self.memo.clear()

    def estimate(self, size: float, context: int) -> float:
        """Seconds at `size`: on the line between the estimates of its bucket and the one below, each taken at its
        bucket's top (two sizes of one bucket, 65 and 127 rows say, must not look equally costly, and a size just
        past a bucket's top must not look cheaper than the top)."""
        key, context_key = bucket(size), bucket(context)
        upper = self._bucket_estimate(key, context_key)
        if key == 1:
            return upper
        lower = self._bucket_estimate(key // 2, context_key)
        return lower + (upper - lower) * (size - key // 2) / (key // 2)

    def _bucket_estimate(self, key: int, context_key: int) -> float:
        """Seconds at the top of bucket `key`, remembered until the next measurement (every session asks a dozen
        of these per step, and the batch's measurements change once per step)."""
        known = self.memo.get((key, context_key))
        if known is None:
            known = self.memo[key, context_key] = self._measured_estimate(key, context_key)
        return known

    def _measured_estimate(self, key: int, context_key: int) -> float:
        if not self.rows:
            return self.prior(key)
        row = self._nearest_row(context_key)
        if key in row:
            return row[key].value
        lower = max((k for k in row if k < key), default=None)
        upper = min((k for k in row if k > key), default=None)
        if lower is not None and upper is not None:
            low, high = row[lower].value, row[upper].value
            return low + (high - low) * (key - lower) / (upper - lower)
        if upper is None:  # NOTE: optimism: past the largest measured size, what that one cost, until tried
            return row[lower].value
        side = sorted(k for k in row if k > key)[:2]
        if len(side) == 2:  # NOTE: along the line through the two smallest measured sizes, no cheaper than the first
            near, far = row[side[0]].value, row[side[1]].value
            return max(near + (far - near) / (side[1] - side[0]) * (key - side[0]), min(near, far))
        return row[upper].value * self.prior(key) / self.prior(upper)

    def _nearest_row(self, context_key: int) -> dict[int, DecayedMean]:
        """The measured row of the context bucket nearest to `context_key` (in powers of two)."""
        near = context_key.bit_length()
        return self.rows[min(self.rows, key=lambda c: (abs(c.bit_length() - near), c))]


class BatchShape(NamedTuple):
    """One engine verify step: its sessions and rows (tree nodes and roots)."""

    sessions: int
    rows: int


@dataclass
class StepCosts:
    """The service's cost models, and the shape of the last verify step. The verify model is keyed by the rows of
    the whole batch: in a batch of many sessions a verify of T rows each costs what N x T rows cost, which a model
    keyed by one session's rows cannot tell (the batch costs about the same whatever one session adds). The priors
    only order the budgets until the first steps are measured: a verify that costs twice as much at 64 rows as at 1
    (benchmarks/results/e2e_step.md: 9.7 ms at 16 rows, 17.5 ms at 64, at 128k), a draft that costs about the
    same at any budget (one drafter forward)."""

    verify: CostModel = field(default_factory=lambda: CostModel(prior_s=0.010, slope=1 / 64))
    draft: CostModel = field(default_factory=lambda: CostModel(prior_s=0.002, slope=0.0))
    batch: BatchShape = BatchShape(1, 1)
    drafts: list[tuple[int, int, float]] = field(default_factory=list)  # measured since the last verify step

    def observe_batch(self, batch: BatchShape, context: int, seconds: float) -> None:
        """An engine verify step took `seconds`; `context`: its sessions' mean KV length. The drafts of
        the step's sessions are learnt now too, so the models change once per step and their estimates are
        remembered in between (a batch's sessions ask them a dozen times each)."""
        for draft in self.drafts:
            self.draft.observe(*draft)
        self.drafts.clear()
        self.verify.observe(batch.rows, context, seconds)
        self.batch = batch

    def observe_draft(self, budget: int, context: int, seconds: float) -> None:
        """A draft of `budget` nodes came back after `seconds` (a miss is no cost of drafting: a stalled drafter is
        not waited on again); learnt at the next verify step."""
        self.drafts.append((budget, context, seconds))

    def seconds(self, budget: int, nodes: float, context: int, besides: float) -> float:
        """A step in which this session's tree has `nodes` nodes (budget 0: no draft at all) and the other
        sessions of the batch verify `besides` rows."""
        draft = self.draft.estimate(budget, context) if budget else 0.0
        return draft + self.verify.estimate(besides + nodes + 1, context)


class BudgetPolicy(Protocol):
    def choose(self, context: int) -> int:
        """The budget of the next step of a session whose KV holds `context` tokens."""

    def observe(self, budget: int, tree: DraftTree | None, path: list[int]) -> None:
        """A step ran with `budget`: `tree` verified (None when none came), `path` its accepted nodes."""




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


@dataclass(frozen=True)
class FixedBudget:
    """One budget every step. With `shared` (a pinned request in a service of adaptive sessions), its trees still
    teach the service's record what each smaller budget would have accepted."""

    budget: int
    shared: Outcomes | None = field(default=None, compare=False)
    candidates: tuple[int, ...] = field(default=(), compare=False)  # the service's: what `shared` is kept for

    def choose(self, context: int) -> int:
        return self.budget

    def observe(self, budget: int, tree: DraftTree | None, path: list[int]) -> None:
        if self.shared is not None and tree is not None and budget:
            for outcome in outcomes(self.candidates, budget, tree, path):
                self.shared.add(*outcome)


class AdaptiveBudget:
    """One session's budgets: each step the candidate with the most expected tokens per second of a batch of
    sessions like it, as many as the last batch had (a session in a batch of 64 weighs its tree of b nodes as 64
    trees of b nodes would cost; its draft overlaps the others').

    What a budget accepts comes from the session's own steps, and until it has verified one of that size, from
    `shared`, the record of all the service's sessions (so a new session does not pay to explore what the others
    know), or, before any session has, from hope (every node accepted). A record weighs less the longer it goes
    unverified (by `age_decay` a step) against what the service's sessions accept, or a fifth of the tree if more
    (weight `hope`): a text that was unpredictable a few steps ago (a model seldom repeats itself from its first
    token) is not taken to stay so, and the more steps a budget has failed, the longer that takes (a text that
    never repeats is seldom drafted for). Its tree is taken at its full size meanwhile, which keeps those returns
    to small budgets where trees are dear.

    An empty draft (the drafter found nothing to propose) counts as a failure only when the one before was empty too,
    and then as a quarter of one.
    Two more ways up: a path that ran into the tree's edge (it ended at a leaf of a tree the budget had cut) tries
    the next candidate up at the next step; and the maximum is verified again as often as keeps those explorations
    under `explore_share` of the batch's time (all its sessions' explorations together)."""

    def __init__(self, max_budget: int, costs: StepCosts, shared: Outcomes, explore_share: float = 0.02,
                 decay: float = 0.8, age_decay: float = 0.8, hope: float = 0.01):
        self.max_budget, self.costs, self.shared = max_budget, costs, shared
        self.explore_share, self.age_decay, self.hope = explore_share, age_decay, hope
        self.candidates = candidate_budgets(max_budget)
        self.own = Outcomes(decay)
        self.steps = 0
        self.verified_at: dict[int, int] = {}  # budget > 0 -> the step that last told its outcome
        self.since_max = 0  # steps since the last one at the maximum, that one included
        self.step_up: int | None = None  # the next step's budget after a path that ran into the edge
        self.last_rows = 1  # this session's rows in its last step
        self.forgive_empty = True  # an empty draft is taken as a failure only after one that was empty too

    def choose(self, context: int) -> int:
        best = max(self.candidates, key=lambda b: (self.tokens_per_s(b, context), -b))
        if best != self.max_budget and self.since_max >= self._exploration_interval(best, context):
            return self.max_budget
        return self.step_up if self.step_up is not None else best

    def expected(self, budget: int) -> tuple[float, float]:
        """(accepted nodes, tree nodes) a step of `budget` can expect: the record, aged, blended with what the
        service's sessions accept and the budget's full size."""
        if budget == 0:
            return 0.0, 0.0
        if budget in self.own:
            record, weight = self.own.mean(budget), self.own.weight(budget)
            age = self.steps - self.verified_at[budget]
        elif budget in self.shared:  # NOTE: as one step of the session's own, taken when it began
            record, weight, age = self.shared.mean(budget), 1.0, self.steps
        else:
            return float(budget), float(budget)
        weight *= self.age_decay ** age
        usual = max(self.shared.mean(budget)[0] if budget in self.shared else budget, HOPE_SHARE * budget)
        return ((weight * record[0] + self.hope * usual) / (weight + self.hope),
                (weight * record[1] + self.hope * budget) / (weight + self.hope))

    def tokens_per_s(self, budget: int, context: int) -> float:
        """Expected tokens per second of a batch of sessions like this one (the last batch's size) at `budget`:
        each session's trees are paid for by the whole batch, and its drafts overlap the others' drafts."""
        accepted, nodes = self.expected(budget)
        besides = (self.costs.batch.sessions - 1) * (nodes + 1)
        return (1 + accepted) / self.costs.seconds(budget, nodes, context, besides)

    def _exploration_interval(self, best: int, context: int) -> float:
        """Steps from one exploration to the next that spend `explore_share` of the batch's time on the
        explorations of all its sessions (each one adds its tree's rows to the batch as it stands)."""
        besides = max(0, self.costs.batch.rows - self.last_rows)
        step = self.costs.seconds(best, self.expected(best)[1], context, besides)
        extra = self.costs.seconds(self.max_budget, self.expected(self.max_budget)[1], context, besides) - step
        return self.costs.batch.sessions * extra / (self.explore_share * step)

    def observe(self, budget: int, tree: DraftTree | None, path: list[int]) -> None:
        self.steps += 1
        self.since_max += 1
        self.step_up = None
        self.last_rows = (len(tree) if tree else 0) + 1
        if tree is None or budget == 0:
            return
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
        if len(tree) == budget and path and path[-1] not in tree.parents:
            self.step_up = next((b for b in self.candidates if b > budget), None)


def session_policy(policy: BudgetPolicyName, max_budget: int, pinned: int, costs: StepCosts,
                   shared: Outcomes) -> BudgetPolicy:
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
