"""What the parts of a step cost, learnt online from measured times: a verify of T rows, a draft of b nodes
(docs/design.md section 4, "The budget of a step": the seconds of the adaptive budget)."""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple


def bucket(n: float) -> int:
    """The power of two at or above n (1 for n <= 1): step times are kept per bucket, not per exact size."""
    return 1 << (max(1, math.ceil(n)) - 1).bit_length()


@dataclass
class DecayedMean:
    """A mean in which each value weighs `decay` times the next one: it follows a drifting quantity and, unlike an
    exponential average started at its first value, does not let that one stand for several."""

    decay: float
    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = self.decay * self.total + weight * value
        self.weight = self.decay * self.weight + weight

    @property
    def value(self) -> float:
        return self.total / self.weight


class Cell(NamedTuple):
    """One (size bucket, context bucket) cell of a cost model: decayed means of its measured times and sizes."""

    seconds: DecayedMean
    size: DecayedMean


class CostModel:
    """Seconds of one part of a step (a verify of T rows, a draft of b nodes), learnt online per (size bucket,
    context bucket) as decayed means of the measured times and of the sizes they were measured at.

    A size is priced on the line through the measured points around it (each bucket's mean size and mean time, the
    times made non-decreasing in size). Past the largest measured size it costs what that one did, until tried: an
    estimate that guessed larger batches dear (a prior, or a line through two small sizes) kept every session from
    ever trying one. Below the smallest it follows the line through the two smallest, no cheaper than the smallest,
    or with one measured size the prior's shape, seconds = prior_s * (1 + slope * size). With no measurement at all
    the prior answers. A context with no measurement borrows the nearest measured context's row. Why buckets: sizes
    and contexts vary step by step, powers of two keep a handful of cells, each one measured often; why their mean
    sizes rather than their tops: a bucket's steps seldom fill it (a batch of 64 one-node trees has 128 rows, with
    three explorations of 63 nodes 337, in the bucket of 512), and a time taken for the top made every row between
    two buckets look several times cheaper than it is; why decayed means: the costs move with the load (other
    sessions share the batch)."""

    def __init__(self, prior_s: float, slope: float, decay: float = 0.9):
        self.prior_s, self.slope, self.decay = prior_s, slope, decay
        self.rows: dict[int, dict[int, Cell]] = {}  # context bucket -> size bucket -> its measurements
        self.lines: dict[int, tuple[list[float], list[float]]] = {}  # context bucket -> its points, until an observe

    def prior(self, size: float) -> float:
        return self.prior_s * (1 + self.slope * size)

    def observe(self, size: float, context: int, seconds: float) -> None:
        cell = self.rows.setdefault(bucket(context), {}).get(bucket(size))
        if cell is None:
            cell = self.rows[bucket(context)][bucket(size)] = Cell(DecayedMean(self.decay), DecayedMean(self.decay))
        cell.seconds.add(seconds)
        cell.size.add(size)
        self.lines.clear()

    def measured(self, size: float, context: int) -> bool:
        """Whether a size of `size`'s bucket was measured at `context`'s bucket."""
        return bucket(size) in self.rows.get(bucket(context), ())

    def largest(self, context: int) -> float:
        """The largest size measured at `context` (or the nearest measured context; 0 before any): past it an
        estimate is a guess (the optimism of `estimate`)."""
        return self._line(bucket(context))[0][-1] if self.rows else 0.0

    def estimate(self, size: float, context: int) -> float:
        """Seconds of a part of `size` at `context` (how: the class's docstring)."""
        if not self.rows:
            return self.prior(size)
        sizes, times = self._line(bucket(context))
        at = bisect.bisect_left(sizes, size)
        if at == len(sizes):  # NOTE: optimism: past the largest measured size, what that one cost, until tried
            return times[-1]
        if sizes[at] == size:
            return times[at]
        if at > 0:
            return times[at - 1] + (times[at] - times[at - 1]) * (size - sizes[at - 1]) / (sizes[at] - sizes[at - 1])
        if len(sizes) == 1:
            return times[0] * self.prior(size) / self.prior(sizes[0])
        # NOTE: along the line through the two smallest measured sizes, no cheaper than the first
        return max(times[0] + (times[1] - times[0]) / (sizes[1] - sizes[0]) * (size - sizes[0]), times[0])

    def _line(self, context_key: int) -> tuple[list[float], list[float]]:
        """The measured points of the context bucket nearest to `context_key` (in powers of two): sizes ascending,
        times non-decreasing; remembered until the next measurement (every session asks a dozen estimates per step,
        and the batch's measurements change once per step)."""
        line = self.lines.get(context_key)
        if line is None:
            near = context_key.bit_length()
            row = self.rows[min(self.rows, key=lambda c: (abs(c.bit_length() - near), c))]
            points = sorted((cell.size.value, cell.seconds.value) for cell in row.values())
            sizes = [size for size, _ in points]
            times = list(itertools.accumulate((seconds for _, seconds in points), max))
            line = self.lines[context_key] = (sizes, times)
        return line


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
    # NOTE: the step loop's own work in a pass, outside its engine calls and its draft round (planning, the draft
    # requests and replies, the events): a drafting pass pays it for its one step, a plain pass shares it over the
    # steps of its burst. Keyed by whether the pass drafted; none until the loop has measured one of each kind.
    pass_host: dict[bool, DecayedMean] = field(default_factory=dict)
    # NOTE: the engine's seconds on the latest prefill chunks. Their median, not a mean: the first chunk of a fresh
    # server may include a kernel's compilation, seconds against milliseconds, and a mean would carry it for long.
    prefill_chunks: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=16))

    def observe_prefill_chunk(self, seconds: float) -> None:
        """A prefill chunk kept the engine `seconds` (its GPU time where there is one)."""
        self.prefill_chunks.append(seconds)

    def prefill_chunk_s(self) -> float | None:
        """What a prefill chunk costs the engine: the median of the latest ones; None before the first."""
        return statistics.median(self.prefill_chunks) if self.prefill_chunks else None

    def observe_pass_host(self, drafting: bool, seconds: float) -> None:
        """A pass spent `seconds` of host work per step (a plain pass: its work over the forwards of its burst)."""
        self.pass_host.setdefault(drafting, DecayedMean(0.9)).add(seconds)

    def pass_host_s(self, drafting: bool) -> float:
        """What a step of a drafting (or plain) pass costs the loop besides the engine and the drafters."""
        known = self.pass_host.get(drafting)
        return known.value if known is not None else 0.0

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
