"""The tree budgets of a pass's sessions, planned together (docs/design.md section 4, "The budget of a step").

The drafts of a pass share one round trip that the whole batch waits for, and their trees one verify step: a
session drafting alone makes every other session wait for its draft round, which no session's own choice weighs
(benchmarks/results/budget_simulation.md)."""

from __future__ import annotations

import numpy as np

from verifier_service.step_costs import StepCosts, bucket
from verifier_service.tree_budget import Offer

# NOTE: the exchange rates tried between a row of the verify step and the tokens it must be expected to bring in,
# from dear rows to free ones (a tie goes to the smaller plan): each rate gives every free session the budget whose
# tree pays best at it, and the plan is the best of those (the rate that balances the batch's step time is not known
# before the plan is)
ROW_PRICES = np.array([*(0.01 * 2 ** (k / 2) for k in reversed(range(16))), 0.0])
# NOTE: a probe's tree: enough nodes to find a text that repeats, few enough that a batch of failed probes costs little
PROBE_BUDGET = 3
# NOTE: ... or a larger tree where it costs at most this many times as much (its round and the pass's host work are
# most of a lone session's probe): one probe then tells what every budget up to it would have accepted
PROBE_GROWTH = 2.0
# NOTE: a session that has not drafted for this many of its steps is probed with the others: a shorter wait probes
# sessions whose drafts have just failed, which their records already tell
PROBE_IDLE_STEPS = 4
# NOTE: the first probe after drafting stopped paying comes 2^-PROBE_BACKOFF of the way into the probes' interval, the
# next twice as far, and so on: a text that has stopped repeating often repeats again soon (a model's first tokens
# after a prompt seldom repeat it, the next ones do), and a long run of probes in vain costs the share only
PROBE_BACKOFF = 4
# NOTE: ... and a long run of vain probes stretches the interval up to this many times (probes at half of
# `probe_share`): where nothing repeats they are all waste; but text that repeats in bursts some tens of steps apart
# is found only by a probe that falls in a burst, and at 4 times a lone session at 128k probed every ~26 steps and
# missed whole bursts that a fixed budget caught (budget_replay_qwen3-8b_h100_84b26e0.md, 50 texts: the worst
# 0.93 -> 0.96 of the best fixed budget, none below 0.95; on the simulated grid the same points within 5%, texts that
# never repeat ~1% lower; at 1, with no stretch, 12 fewer points within 5% there)
PROBE_SLOWEST = 2.0
# NOTE: drafting "pays" again, and the probes' backoff starts over, once it pays for this share of the free sessions:
# a few sessions whose drafts happen to pay say little of the idle ones, and restarting the backoff on each of their
# passes probed every idle session several times as often as the share allows (budget_simulation.md, drafts that
# seldom pay)
PAYING_SHARE = 0.5
# NOTE: a plain step of the batch's size that was never measured is, once, when drafting does not look at least this
# many times faster: its estimate is a guess from larger steps, and a step's cost may be mostly per tree (host work)
# rather than per row, which only a measurement tells
PLAIN_DOUBT = 2.0
# NOTE: a plan in which nobody drafts holds for the same sessions for up to this many passes without their offers
# asked again: only their records' aging moves those offers meanwhile (over tens of steps), and asking 64 sessions and
# planning them costs a plain pass about as much host work as the rest of it (H200, Qwen3-0.6B shape, 64 sessions,
# acceptance ~1: 0.78 ms of host per plain step against 0.42 without a drafter)
HOLD_PASSES = 4


class BudgetPlanner:
    """Each pass's budgets. Pinned sessions get theirs. The free ones get the plan with the most expected tokens per
    second of the whole batch (sessions that step plainly beside them included), among: every free session plain,
    and, for each price a row may cost, each free session at the budget that maximises its expected accepted nodes
    minus the price of its tree. The draft round costs what its largest draft does, once, if anyone drafts at all,
    and the loop's own work for the pass as measured for drafting passes (for plain ones, a burst's share).

    Sessions that do not draft (their records say their drafts fail) are probed together at a small budget (or a
    larger one that costs little more), as often as keeps the probes under `probe_share` of the batch's time: a
    text that did not repeat may start to, and a probe that finds it lets the session climb (a path that runs into
    the edge of its tree tries the next size up, which it has in the next pass that drafts at all, or once most of
    them ask). Probing them together pays one draft round for all."""

    def __init__(self, costs: StepCosts, probe_share: float = 0.03):
        self.costs, self.probe_share = costs, probe_share
        self.since_probe = 0  # passes since the last probe
        self.vain_probes = 0  # probes since the last pass in which drafting paid (PAYING_SHARE)
        self.probe_wait = 0.0  # the passes between probes, as the last plan saw them
        self.plain_for: frozenset | None = None  # the sessions of the last plan, when nobody drafted in it
        self.held = 0  # passes since that plan that it held for

    def holds(self, sessions: frozenset) -> bool:
        """Whether this pass of `sessions` (any hashable names) may skip its plan: the last plan was for the same
        sessions, nobody drafted in it, it has held for fewer than HOLD_PASSES - 1 passes since, and no probe is due
        (the last plan had idle sessions and their next probe is not yet). Counts the pass when it may."""
        if not self._steady(sessions) or self.held >= HOLD_PASSES - 1:
            return False
        self.held += 1
        self.since_probe += 1
        return True

    def plans_ahead(self, sessions: frozenset) -> bool:
        """Whether the plan of the pass after the next one of `sessions` may be made now, while the step before
        it runs (`plan_plain`): the last plan, in which nobody drafted, has held as long as it may, and nothing
        else calls for a plan from the latest records. Where sessions have just stopped drafting (not idle long
        enough to be probed) a plan a step old missed their first probe by a burst: in the simulation a warm-up
        session lost 15% of its rate."""
        return self._steady(sessions) and self.held >= HOLD_PASSES - 1

    def _steady(self, sessions: frozenset) -> bool:
        """The last plan was for `sessions`, nobody drafted in it, its sessions are idle and their next probe is
        not due at the next pass."""
        return sessions == self.plain_for and bool(self.probe_wait) and self.since_probe + 1 < self.probe_wait

    def plan(self, offers: list[Offer], context: int, besides: int = 0, hidden_s: float = 0.0,
             sessions: frozenset | None = None) -> list[int]:
        """The budgets of `offers`' sessions in a pass where `besides` more sessions step plainly; `context`: the
        sessions' mean KV length; `hidden_s`: the engine's work for other cohorts while this pass's drafts are out
        (`--step-cohorts`), which a draft round no longer than it costs nothing beside. `sessions`: the offers'
        names, for `holds` (None: the plan never holds)."""
        budgets = self._plan(offers, context, besides, hidden_s)
        self.plain_for, self.held = (sessions if not any(budgets) else None), 0
        return budgets

    def plan_plain(self, offers: list[Offer], context: int, besides: int = 0, hidden_s: float = 0.0,
                   sessions: frozenset | None = None) -> bool:
        """`plan`, made ahead of its pass (while the step before it runs): kept when nobody drafts in it (True);
        otherwise undone (False), so that the pass plans when it comes, from its sessions' latest records. A plan
        kept holds one pass less: made from records a step older than its pass's, it would otherwise stand for
        records older than any plan made by its pass."""
        state = self.since_probe, self.vain_probes, self.probe_wait, self.plain_for, self.held
        if not any(self.plan(offers, context, besides, hidden_s, sessions)):
            self.held = 1
            return True
        self.since_probe, self.vain_probes, self.probe_wait, self.plain_for, self.held = state
        return False

    def _plan(self, offers: list[Offer], context: int, besides: int, hidden_s: float) -> list[int]:
        self.since_probe += 1
        self.probe_wait = 0.0
        budgets = [offer.pinned or 0 for offer in offers]
        free = [i for i, offer in enumerate(offers) if offer.pinned is None]
        if not free:
            return budgets
        pass_ = _Pass(self.costs, offers, free, context, besides, hidden_s)
        choice = pass_.best_choice()
        if np.count_nonzero(choice) >= PAYING_SHARE * len(choice):  # NOTE: free is never empty here
            self.vain_probes = 0
        candidates = offers[free[0]].candidates
        for i, chosen in zip(free, choice):
            budgets[i] = candidates[chosen]
        idle = [i for i in free if budgets[i] == 0 and offers[i].idle >= PROBE_IDLE_STEPS]
        probe, interval = self._probe(pass_, choice, idle, candidates)
        backoff = min(PROBE_SLOWEST, 2.0 ** (self.vain_probes - PROBE_BACKOFF))
        wait = backoff * interval
        self.probe_wait = wait if idle and probe else 0.0
        if idle and probe and self.since_probe >= wait:
            for i in idle:
                budgets[i] = probe
            self.since_probe = 0
            self.vain_probes += 1
        # NOTE: a step up asked for, in a pass that drafts anyway (its rows are all it costs) or when most ask (the
        # text has started to repeat for most: their probes ran into their trees' edges)
        if any(budgets) or sum(1 for i in free if offers[i].wanted) >= PAYING_SHARE * len(free):
            for i in free:
                budgets[i] = max(budgets[i], offers[i].wanted)
        return budgets

    def _probe(self, pass_: _Pass, choice: np.ndarray, idle: list[int],
               candidates: tuple[int, ...]) -> tuple[int, float]:
        """(budget, interval) of the `idle` sessions' probes: PROBE_BUDGET nodes, or the largest candidate whose
        probe costs at most PROBE_GROWTH times as much; the passes from one probe to the next that keep probes of
        PROBE_BUDGET nodes under `probe_share` of the batch's time, the pass planned as `choice` (a larger probe
        comes as often: sized by its price, it tells every budget up to it at little more cost; budget_replay_edits.md,
        lone sessions of a 0.6B model, whose probes of 3 told little of the trees of 63 that paid: the worst edit
        0.68 -> 0.76x the best fixed budget)."""
        smallest = min(PROBE_BUDGET, candidates[-1])
        if not idle or not smallest:
            return smallest, 0.0
        draft_s, rows = float(pass_.draft_s(choice)), float(pass_.rows(choice))
        verify, context = self.costs.verify, pass_.context
        host_s = pass_.host_s(pass_.drafting(choice))
        step = draft_s + verify.estimate(rows, context) + host_s

        def extra(probe: int) -> float:
            """Seconds a probe of the idle sessions at `probe` adds to the pass."""
            return (max(draft_s, self.costs.draft.estimate(probe, context)) - draft_s
                    + verify.estimate(rows + len(idle) * probe, context) - verify.estimate(rows, context)
                    + pass_.host_s(True) - host_s)

        least, largest, probe = extra(smallest), verify.largest(context), smallest
        for budget in (b for b in candidates if b > smallest):
            # NOTE: past the largest size verified the verify's estimate is a guess (CostModel.estimate's optimism):
            # a probe reaches at most twice as far, and the next one past that once it has been measured
            if extra(budget) > PROBE_GROWTH * least or rows + len(idle) * budget > 2 * largest:
                break
            probe = budget
        return probe, least / (self.probe_share * step)


class _Pass:
    """One pass's plans: the free sessions' candidates (`choice`: an index into the candidates per free session)
    against what the pinned and plain sessions fix."""

    def __init__(self, costs: StepCosts, offers: list[Offer], free: list[int], context: int, besides: int,
                 hidden_s: float = 0.0):
        self.costs, self.context, self.hidden_s = costs, context, hidden_s
        candidates = offers[free[0]].candidates
        pinned = [offer.pinned for offer in offers if offer.pinned]
        self.fixed_tokens = len(offers) + besides  # NOTE: a pinned session's tokens are the same in every plan
        self.fixed_rows = sum(pinned) + len(offers) + besides
        self.fixed_draft_s = max((costs.draft.estimate(b, context) for b in pinned), default=0.0)
        self.candidate_draft_s = np.array([costs.draft.estimate(b, context) if b else 0.0 for b in candidates])
        self.accepted = np.array([offers[i].accepted for i in free])
        weights = self.row_weights([offers[i].context for i in free])
        self.nodes = np.array([offers[i].nodes for i in free]) * weights[:, None]  # NOTE: in rows at `context`

    def row_weights(self, contexts: list[int]) -> np.ndarray:
        """What a tree row of a session whose KV holds each context costs, in rows at the batch's mean context: a
        row's attention reads the session's own prefix (at 128k a row costs several times one at 1k). The verify
        model's slope at that context over its slope at the batch's, once per context bucket (the model's unit); 1
        for context 0 and where the model knows no other context."""
        here = self.row_slope(self.context)
        by_bucket: dict[int, float] = {}
        for context in contexts:
            if context and bucket(context) not in by_bucket:
                there = self.row_slope(context)
                by_bucket[bucket(context)] = there / here if here > 0 and there > 0 else 1.0
        return np.array([by_bucket[bucket(context)] if context else 1.0 for context in contexts])

    def row_slope(self, context: int) -> float:
        """Seconds a verify row adds at `context`, from batches of this pass's fixed rows to twice as many."""
        verify, rows = self.costs.verify, self.fixed_rows
        return verify.estimate(2 * rows, context) - verify.estimate(rows, context)

    def best_choice(self) -> np.ndarray:
        """The choice with the most expected tokens per second: all plain, or the best price's, unless the plain
        step of this batch was never measured and the drafting plan's edge over it is a guess (PLAIN_DOUBT)."""
        priced = (self.accepted[None] - ROW_PRICES[:, None, None] * self.nodes[None]).argmax(-1)
        choices = np.concatenate([np.zeros((1, len(self.accepted)), dtype=np.int64), priced])
        rates = self.rates(choices)
        best = int(rates.argmax())  # NOTE: the first of equals: plain, then from dear rows to cheap ones
        measured = self.costs.verify.measured(self.fixed_rows, self.context)
        return choices[best] if measured or rates[best] >= PLAIN_DOUBT * rates[0] else choices[0]

    def rates(self, choices: np.ndarray) -> np.ndarray:
        """Expected tokens per second of the pass for each row of `choices` (the free sessions' candidates)."""
        sessions = np.arange(choices.shape[1])[None]
        tokens = self.fixed_tokens + self.accepted[sessions, choices].sum(1)
        seconds = [draft_s + self.costs.verify.estimate(rows, self.context) + self.host_s(drafting)
                   for draft_s, rows, drafting in zip(self.draft_s(choices), self.rows(choices),
                                                      self.drafting(choices))]
        return tokens / np.array(seconds)

    def drafting(self, choices: np.ndarray) -> np.ndarray:
        """Whether each plan drafts at all (a pinned draft makes every plan draft)."""
        return (choices > 0).any(-1) | (self.fixed_draft_s > 0)

    def host_s(self, drafting: bool) -> float:
        """The loop's own work in a step of the plan: a drafting pass pays it for one step, a plain one shares it
        over its burst (measured per kind of pass: on the H200 a drafting pass's is several times a plain step's,
        which the verify and draft models do not see)."""
        return self.costs.pass_host_s(bool(drafting))

    def rows(self, choices: np.ndarray) -> np.ndarray:
        return self.fixed_rows + self.nodes[np.arange(choices.shape[-1]), choices].sum(-1)

    def draft_s(self, choices: np.ndarray) -> np.ndarray:
        """The part of the draft round the pass waits for: the largest draft's, less the other cohorts' work."""
        round_s = np.maximum(self.fixed_draft_s, self.candidate_draft_s[choices].max(-1))
        return np.maximum(round_s - self.hidden_s, 0.0)
