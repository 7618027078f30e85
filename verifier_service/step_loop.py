"""The one loop that steps every generation past its prefill (the scheduling loop of nano-vllm's and vLLM's
engines). Each pass plans its sessions' budgets together (BudgetPlanner), asks the drafters for all the trees at
once (one batch message per replica, one deadline), verifies them together in one engine step (more when the batch
limits split them, the longest-stepping sessions first), and puts each step's event into its generation's sink: a
GenerateStream's outbox (no task wakes per step), or a queue read as an iterator. Sessions join between passes (one
that joins while the drafts are out steps in the same pass: its first step needs no draft) and leave at any time.

A pass's host work runs beside the GPU: a step whose events have not been streamed yet runs on the engine thread
while the loop streams them, and the drafters' round trip leaves the loop to the streams too. While a batch only
decodes plainly (no drafter, or a plan in which nobody drafts that holds), each burst is queued on the engine before
the last one's events are handed on; while a prefill is under way, a burst holds its next chunk up no longer than
the chunk itself takes (`_burst_steps`). A generation whose sink is full (its reader is behind) sits passes out until
the sink has room, rather than letting steps pile up.

With several cohorts (`--step-cohorts`), each cohort's generations have passes of their own, in turn: one cohort's
drafts are out while another's step runs, so neither the GPU nor the drafters wait for the other."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from modeling.speculation import StepCursor
from modeling.tree import DraftTree, TreeError
from verifier_service.budget_planner import BudgetPlanner
from verifier_service.drafter_pool import DrafterPool
from verifier_service.engine.engine import Engine, StepResult
from verifier_service.engine.session import Session
from verifier_service.errors import CapacityError, EngineDown
from verifier_service.gpu_clock import GpuClock
from verifier_service.metrics import VerifierMetrics
from verifier_service.step_costs import BatchShape, StepCosts
from verifier_service.tree_budget import BudgetPolicy, Offer
from verifier_service.worker import EngineWorker

log = logging.getLogger(__name__)

# NOTE: a consumer hands its events on at once (to its stream's outbox, which has its own limit and the gateway's
# credit): only a consumer held up downstream has two waiting (three, when a burst was queued before its second went
# out: StepLoop._burst), and it sits passes out until it takes them.
RUN_AHEAD = 2


@dataclass(frozen=True)
class StepEvent:
    step: int
    result: StepResult
    drafted_nodes: int
    draft_wait_s: float  # from the pass's start until its drafts were in
    verify_s: float  # from then until the session's engine step ended


class StepSink(Protocol):
    """Where a generation's step events go, from the loop itself: `put` must not wait."""

    def put(self, event: StepEvent) -> None: ...

    def has_room(self) -> bool:
        """False holds the generation out of the passes (its reader is behind) until the loop's `wake`."""


class EventQueue:
    """The sink of a generation read as an iterator (`StepLoop.steps`)."""

    def __init__(self) -> None:
        self.events: collections.deque[StepEvent] = collections.deque()
        self.arrived = asyncio.Event()

    def put(self, event: StepEvent) -> None:
        self.events.append(event)
        self.arrived.set()

    def has_room(self) -> bool:
        return len(self.events) < RUN_AHEAD

    async def next(self, done: asyncio.Future) -> StepEvent:
        """The next event; the generation's error once it has failed and its events are taken."""
        while not self.events:
            if done.done():
                done.result()
            self.arrived.clear()
            await self.arrived.wait()
        return self.events.popleft()


class Stepper:
    """One generation in the loop: its session, where its drafting stands, its budget policy, its sink, and `done`
    (set once its last step is delivered, or to its error)."""

    def __init__(self, session: Session, budgets: BudgetPolicy, sink: StepSink, cohort: int = 0):
        self.session, self.budgets, self.sink, self.cohort = session, budgets, sink, cohort
        self.session_id = session.session_id
        self.cursor = StepCursor(session.session_id, session.kv_len)
        self.done = asyncio.get_running_loop().create_future()

    def deliver(self, event: StepEvent) -> None:
        self.sink.put(event)
        if event.result.finished and not self.done.done():
            self.done.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)


@dataclass
class _Planned:
    """A stepper's part of one pass."""

    stepper: Stepper
    budget: int
    tree: DraftTree | None = None  # None: none came (no drafter, a miss, a bad tree)
    seeding: bool = False  # its draft opened a mirror first (no cost of its steps)
    opening: bool = False  # plain while its drafter mirror opens: no choice of its budget policy's


class StepLoop:
    def __init__(self, engine: Engine, worker: EngineWorker, drafters: DrafterPool | None,
                 metrics: VerifierMetrics, costs: StepCosts, cohorts: int = 1,
                 prefilling: Callable[[], bool] = lambda: False):
        """cohorts: groups of generations that step in turn, each with passes of its own: while one cohort's
        step is on the GPU, the next one's drafts are out (a pass otherwise waits for its draft round with the GPU
        idle). Each generation joins the smallest cohort. prefilling: whether a prefill is under way (its chunks
        share the engine with the steps: `_burst_steps`)."""
        if cohorts < 1:
            raise ValueError(f"cohorts must be >= 1, got {cohorts}")
        self.engine, self.worker, self.drafters, self.metrics, self.costs = engine, worker, drafters, metrics, costs
        self.prefilling = prefilling
        self.planner = BudgetPlanner(costs)
        self.steppers: dict[str, Stepper] = {}  # in joining order: the longest-stepping first in a split pass
        self.wakeups = [asyncio.Event() for _ in range(cohorts)]
        self.busy_since: float | None = None  # when the latest engine step ended, while sessions were stepping
        self.busy_mark = 0.0  # the worker's busy seconds then: what ran on the engine since is not the host's time
        self.streaming = False  # events went out and the loop has not had a turn since (their readers have work)
        self.deliveries = 0  # batches whose events went out
        self.last_call_seconds = 0.0  # the latest engine call's wall time
        self.last_run_seconds = 0.0  # the same call's own run on the engine, without its wait behind queued work
        self.clock = GpuClock.for_device(engine.config.device)
        self.clocked: collections.deque[tuple[float, int]] = collections.deque()  # (wall s, forwards) per call
        self.cohort_step_seconds = [0.0] * cohorts  # each cohort's last pass from its drafts in to its end
        self.down_reason: str | None = None
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._run(cohort), name=f"step-loop-{cohort}")
                      for cohort in range(len(self.wakeups))]

    async def stop(self) -> None:
        """No generation waits on a loop that is gone: those still stepping fail with EngineDown (UNAVAILABLE)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.fail("the verifier is stopping")

    def fail(self, reason: str) -> None:
        """The engine is down: every stepping generation fails with EngineDown now (the engine thread may be stuck
        in a collective with a dead rank), and so does every later one."""
        self.down_reason = reason
        for stepper in self.steppers.values():
            stepper.fail(EngineDown(reason))
        self.steppers.clear()

    def wake(self) -> None:
        """A sink has room again: a loop that idles for want of ready generations looks again."""
        for wakeup in self.wakeups:
            wakeup.set()

    async def run(self, session: Session, budgets: BudgetPolicy, sink: StepSink) -> None:
        """Step the session until a stop, each step's event put into `sink` by the loop itself (no task of the
        caller's wakes per step). The first step verifies the pending prompt token alone, so the first token goes out
        as soon as the prefill is done (as the DDTree reference's prefill emits it) and the first draft starts from
        it. Returns once the last step is delivered; raises the generation's error."""
        stepper = self._join(session, budgets, sink)
        try:
            await stepper.done
        finally:
            self._leave(stepper)

    async def steps(self, session: Session, budgets: BudgetPolicy) -> AsyncIterator[StepEvent]:
        """`run` read as an iterator of the step events."""
        queue = EventQueue()
        stepper = self._join(session, budgets, queue)
        stepper.done.add_done_callback(lambda _: queue.arrived.set())
        try:
            while True:
                event = await queue.next(stepper.done)
                if len(queue.events) == RUN_AHEAD - 1:
                    self.wake()  # NOTE: it had sat passes out: room again
                yield event
                if event.result.finished:
                    return
        finally:
            self._leave(stepper)

    def _join(self, session: Session, budgets: BudgetPolicy, sink: StepSink) -> Stepper:
        if self.down_reason is not None:
            raise EngineDown(self.down_reason)
        sizes = collections.Counter(stepper.cohort for stepper in self.steppers.values())
        stepper = Stepper(session, budgets, sink, min(range(len(self.wakeups)), key=sizes.__getitem__))
        self.steppers[stepper.session_id] = stepper
        self.wake()
        return stepper

    def _leave(self, stepper: Stepper) -> None:
        self._drop(stepper)
        if not stepper.done.done():
            stepper.done.cancel()
        elif not stepper.done.cancelled():
            stepper.done.exception()  # NOTE: an error its reader left before taking is not "never retrieved"
        if self.drafters is not None:  # NOTE: features no draft carried, for the next turn's seed
            self.drafters.add_features(stepper.session_id, stepper.cursor.features)

    def _drop(self, stepper: Stepper) -> None:
        if self.steppers.get(stepper.session_id) is stepper:
            del self.steppers[stepper.session_id]

    def _ready(self, cohort: int | None = None) -> list[Stepper]:
        """The generations (of `cohort`, or all) whose sinks have room."""
        return [stepper for stepper in self.steppers.values()
                if stepper.sink.has_room() and cohort in (None, stepper.cohort)]

    async def _run(self, cohort: int) -> None:
        wakeup = self.wakeups[cohort]
        while True:
            steppers = self._ready(cohort)
            if not steppers or self.down_reason is not None:
                if not self._ready():
                    self.busy_since = None  # NOTE: an idle engine is no host overhead
                wakeup.clear()
                await wakeup.wait()
                continue
            try:
                await self._pass(steppers)
            except Exception as error:  # noqa: BLE001 - the loop outlives a failed pass; its generations end
                log.exception("a step pass failed")
                for stepper in steppers:
                    self._drop(stepper)
                    stepper.fail(error)

    async def _pass(self, steppers: list[Stepper]) -> None:
        started = time.perf_counter()
        plans = self._plans(steppers)
        drafting = [plan for plan in plans if plan.budget]
        planned_at = time.perf_counter()
        await self._draft(drafting)
        drafted = time.perf_counter()
        if drafting:  # NOTE: a seed's round costs tenths of a second: kept apart, it would swamp the steady rounds
            seeding = any(plan.seeding for plan in drafting)
            rounds = self.metrics.seed_seconds if seeding else self.metrics.draft_round_seconds
            rounds.observe(drafted - started)
        planned = {plan.stepper.session_id for plan in plans}
        # NOTE: a generation that left while the drafts were out must not step (its session is being released); one
        # that joined meanwhile steps now, since its first step needs no draft
        plans = [plan for plan in plans if self.steppers.get(plan.stepper.session_id) is plan.stepper]
        plans += [_Planned(stepper, 0) for stepper in self._ready(steppers[0].cohort)
                  if stepper.session_id not in planned and stepper.cursor.step == 0]
        engine_s, forwards = 0.0, 0
        for batch in self._batches(plans):
            batch_s, batch_forwards = await self._verify(batch, started, drafted)
            engine_s, forwards = engine_s + batch_s, forwards + batch_forwards
        ended = time.perf_counter()
        self.cohort_step_seconds[steppers[0].cohort] = ended - drafted
        if forwards and len(self.wakeups) == 1:  # NOTE: with cohorts, others' steps fill this pass's gaps
            self._observe_host_work(bool(drafting), ended - started - engine_s - (drafted - planned_at), forwards)

    def _observe_host_work(self, drafted: bool, outside_s: float, forwards: int) -> None:
        """A pass spent `outside_s` seconds neither in its engine calls (`forwards` model forwards) nor waiting for
        its draft round: a drafting pass pays it for one step, a plain pass shares it over its burst's steps (the
        budget planner weighs the two)."""
        per_step = max(outside_s, 0.0) / (1 if drafted else forwards)
        histogram = self.metrics.drafting_pass_host_seconds if drafted else self.metrics.plain_step_host_seconds
        histogram.observe(per_step)
        self.costs.observe_pass_host(drafted, per_step)

    def _plans(self, steppers: list[Stepper]) -> list[_Planned]:
        """The steppers' parts of this pass, in their order: a first step (or any step with no drafter, or whose
        drafter mirror is still opening) plain, the other steps' budgets planned together from their policies'
        offers (BudgetPlanner). A stepper whose policy fails is left out, its generation ended alone."""
        if self.drafters is None:
            return [_Planned(stepper, 0) for stepper in steppers]
        opening = self._opening(steppers)
        offering = self._offering(steppers, opening)
        if self.planner.holds(offering):  # NOTE: the last plan, all plain, stands: no offers asked
            return [_Planned(stepper, 0, opening=stepper.session_id in opening) for stepper in steppers]
        offered, steppers = self._offers(steppers, offering)
        if not offered:
            return [_Planned(stepper, 0, opening=stepper.session_id in opening) for stepper in steppers]
        budgets = dict(zip(offered, self.planner.plan(*self._plan_inputs(steppers, offered))))
        return [_Planned(stepper, budgets.get(stepper.session_id, 0), opening=stepper.session_id in opening)
                for stepper in steppers]

    def _offers(self, steppers: list[Stepper], offering: frozenset[str]) -> tuple[dict[str, Offer], list[Stepper]]:
        """The offers of the `offering` steppers, and the steppers still stepping: one whose policy fails is
        dropped, its generation ended."""
        offered: dict[str, Offer] = {}
        for stepper in steppers:
            if stepper.session_id in offering:
                try:
                    offered[stepper.session_id] = stepper.budgets.offer(stepper.session.kv_len)
                except Exception as error:  # noqa: BLE001 - handed to its generation
                    log.exception("session %s: its tree budget's offer failed", stepper.session_id)
                    self._drop(stepper)
                    stepper.fail(error)
        return offered, [stepper for stepper in steppers if self.steppers.get(stepper.session_id) is stepper]

    def _plan_inputs(self, steppers: list[Stepper], offered: dict[str, Offer]
                     ) -> tuple[list[Offer], int, int, float, frozenset[str]]:
        """The planner's arguments for a pass of `steppers` whose `offered` ones are planned."""
        context = sum(stepper.session.kv_len for stepper in steppers if stepper.session_id in offered) // len(offered)
        # NOTE: with cohorts, the others' steps run while this pass's drafts are out (each runs once meanwhile)
        hidden_s = sum(self.cohort_step_seconds) - self.cohort_step_seconds[steppers[0].cohort]
        return list(offered.values()), context, len(steppers) - len(offered), hidden_s, frozenset(offered)

    def _plan_ahead(self, batch: list[_Planned]) -> frozenset[str] | None:
        """While `batch`'s burst runs: the plan of the pass after it, where that pass would plan only because the
        last plan has held as long as it may (BudgetPlanner.plans_ahead), and nobody drafts in it (`plan_plain`):
        the sessions it is for, whose next burst is then queued as this one ends (`_next_burst`). Otherwise that
        pass's burst waited for this one's events to be handed on and then for the offers and the plan, the GPU
        idle (H200, Qwen3-0.6B shape, 64 sessions at acceptance ~1: a gap of ~1.8 ms between engine calls against
        plain decoding's 0.6). None: the pass plans when it comes, from its sessions' latest records."""
        if self.drafters is None or len(self.wakeups) > 1:
            return None
        steppers = [plan.stepper for plan in batch]
        offering = self._offering(steppers, self._opening(steppers))
        if not self.planner.plans_ahead(offering):
            return None
        offered, steppers = self._offers(steppers, offering)
        if not offered or not self.planner.plan_plain(*self._plan_inputs(steppers, offered)):
            return None
        return frozenset(offered)

    def _opening(self, steppers: Iterable[Stepper]) -> set[str]:
        """The generations whose drafter mirrors are still opening (asked once a pass)."""
        return {stepper.session_id for stepper in steppers if self.drafters.opening(stepper.session_id)}

    @staticmethod
    def _offering(steppers: Iterable[Stepper], opening: set[str]) -> frozenset[str]:
        """The generations whose budgets a pass plans: past their first step, their drafter mirrors open."""
        return frozenset(stepper.session_id for stepper in steppers
                         if stepper.cursor.step and stepper.session_id not in opening)

    async def _draft(self, plans: list[_Planned]) -> None:
        """Every plan's tree, asked together; a miss or a bad tree costs its session one step of speculation."""
        if not plans:
            return
        drafters = self.drafters
        for plan in plans:
            plan.seeding = not drafters.is_open(plan.stepper.session_id)
        steps = [plan.stepper.cursor.draft_step(plan.stepper.session.root, plan.budget) for plan in plans]
        for plan, tree in zip(plans, await drafters.draft_all(steps)):
            plan.tree = self._checked(tree)

    def _checked(self, tree: DraftTree | None) -> DraftTree | None:
        if tree is None:
            self.metrics.draft_misses.inc()
            return None
        try:
            tree.validate(self.engine.model_config.vocab_size, self.engine.config.max_tree_nodes)
        except TreeError:
            self.metrics.bad_trees.inc()  # NOTE: a bad tree costs one step of speculation, nothing more
            return None
        return tree

    def _batches(self, plans: list[_Planned]) -> list[list[_Planned]]:
        """The pass's steps in engine batches of at most max_batch_tokens rows and max_batch_sessions sessions (a
        step that fits nowhere goes alone, and the engine refuses it)."""
        config, batches, rows = self.engine.config, [], 0
        for plan in plans:
            size = (len(plan.tree) if plan.tree else 0) + 1
            if not batches or rows + size > config.max_batch_tokens or len(batches[-1]) == config.max_batch_sessions:
                batches.append([])
                rows = 0
            batches[-1].append(plan)
            rows += size
        return batches

    async def _verify(self, batch: list[_Planned], started: float, drafted: float) -> tuple[float, int]:
        """The batch's step, and its burst of plain steps where it has one; the seconds of its engine calls and the
        forwards they ran (none where they failed). A batch that only decodes plainly past its first steps is one
        burst (Engine.decode). Otherwise the tree step runs first, and its events go out (a joining session's first
        token must not wait for a burst); when the batch has a plain session and none of its drafts was accepted,
        everyone then goes on in a burst, queued before those events go out: the burst would only hold back
        sessions whose drafts pay."""
        wanted = self.engine.config.decode_burst_steps
        plain = [plan for plan in batch if plan.tree is None and plan.stepper.cursor.step]
        if wanted > 1 and len(plain) == len(batch):
            forwards, engine_s = await self._burst(batch, wanted, started, drafted)
            if forwards:
                return engine_s, forwards
            wanted = 1  # NOTE: the burst was refused (the KV cannot hold it, say): one step instead
        results = await self._step(batch, started, drafted)
        if not results:
            return 0.0, 0
        engine_s, forwards = self.last_call_seconds, 1  # NOTE: this step's: no await since it ended
        burst = None
        if wanted > 1 and plain and not any(result.accepted for result in results):
            # NOTE: queued before the step's events are handed on, so the GPU does not wait for the hand-over
            burst = self._queue_burst([_Planned(plan.stepper, 0, opening=plan.opening)
                                       for plan in self._going_on(batch, results)], wanted - 1, now=True)
        self._deliver_all(batch, results, started, drafted)
        if burst is not None:
            burst_forwards, burst_s = await self._bursts(burst, started, drafted)
            engine_s, forwards = engine_s + burst_s, forwards + burst_forwards
        return engine_s, forwards

    async def _step(self, batch: list[_Planned], started: float, drafted: float) -> list[StepResult]:
        """The batch's verify step (a plain session's is its one row); its results, for the caller to hand on;
        none when it failed (each session then stepped alone, its own result handed on)."""
        steps = [(plan.stepper.session_id, plan.tree or DraftTree.empty()) for plan in batch]
        try:
            results = await self._engine_call(self.engine.step, steps)
        except Exception as error:  # noqa: BLE001 - handed to the generation at fault
            if self.down_reason is not None:
                return []
            if len(batch) == 1:
                self._drop(batch[0].stepper)
                batch[0].stepper.fail(error)
                return []
            # NOTE: the engine validates and reserves pages before it runs anything, so a failed batch changed
            # nothing; stepping the sessions one by one isolates the one at fault.
            for plan in batch:
                if alone := await self._step([plan], started, drafted):
                    self._deliver_all([plan], alone, started, drafted)
            return []
        self._observe_batch(steps, results, self.last_run_seconds)
        return results

    async def _burst(self, batch: list[_Planned], wanted: int, started: float, drafted: float) -> tuple[int, float]:
        """Up to `wanted` plain steps of the batch in one engine call; the forwards run and the seconds of the engine
        calls, 0 forwards when none ran (the KV cannot hold it, or the engine refused it: the sessions then go on
        step by step, where a fault is isolated). While the next pass would only run another burst of the same
        generations (`_next_burst`), that burst is queued on the engine before this one's events are handed on, so
        the GPU does not wait for the hand-over and the next pass (vLLM's asynchronous scheduling)."""
        return await self._bursts(self._queue_burst(batch, wanted, now=False), started, drafted)

    async def _bursts(self, burst: tuple[list[_Planned], int, Awaitable[list[StepResult]]] | None, started: float,
                      drafted: float) -> tuple[int, float]:
        """`burst` (from `_queue_burst`) and the bursts that follow it at once: see `_burst`."""
        forwards, engine_s, planned = 0, 0.0, None
        while burst is not None:
            batch, steps, call = burst
            try:
                results = await call
            except Exception as error:  # noqa: BLE001 - a burst is an optimisation: its refusal fails no one
                self._burst_refused(error)
                return forwards, engine_s
            self._observe_batch([(plan.stepper.session_id, DraftTree.empty()) for plan in batch], results,
                                self.last_run_seconds / steps)
            burst = self._queue_burst(self._next_burst(batch, results, planned),
                                      self.engine.config.decode_burst_steps, now=True)
            self._deliver_all(batch, results, started, drafted)
            forwards, engine_s = forwards + steps, engine_s + self.last_call_seconds
            planned = self._plan_ahead(burst[0]) if burst is not None else None
        return forwards, engine_s

    def _queue_burst(self, batch: list[_Planned], wanted: int, now: bool
                     ) -> tuple[list[_Planned], int, Awaitable[list[StepResult]]] | None:
        """The batch's burst: its plans, its steps and its results to await, queued on the engine at once when `now`
        (else when awaited); None for an empty batch or one that cannot burst (a session released meanwhile)."""
        if not batch:
            return None
        session_ids = [plan.stepper.session_id for plan in batch]
        try:
            steps = self.engine.burst_length(session_ids, self._burst_steps(batch, wanted))
        except Exception as error:  # noqa: BLE001 - see _burst
            self._burst_refused(error)
            return None
        call = self._engine_submit if now else self._engine_call
        return batch, steps, call(self.engine.decode, session_ids, steps, forwards=steps)

    def _burst_steps(self, batch: list[_Planned], wanted: int) -> int:
        """The steps of the batch's next burst: `wanted`, or while a prefill is under way, as many as take the engine
        about as long as one of its chunks (the cost models' estimates; one before a chunk was measured): the chunk,
        queued behind the burst, then waits about its own time. Bursts of the whole `wanted` made each of 64 prompts
        arriving together wait a burst of steps for its chunk (H200, Qwen3-0.6B shape, bursts of 16: mean TTFT 2.8-3.0
        s against 2.0-2.2 s with 8, and the first session finished before the last one started,
        benchmarks/results/throughput_decode_bursts.md); a long prompt's chunks of thousands of tokens still
        alternate with bursts of every step wanted."""
        if wanted == 1 or not self.prefilling():
            return wanted
        chunk_s = self.costs.prefill_chunk_s()
        if chunk_s is None:
            return 1
        context = sum(plan.stepper.session.kv_len for plan in batch) // len(batch)
        step_s = self.costs.verify.estimate(len(batch), context)
        return max(1, min(wanted, int(chunk_s / step_s)))

    def _burst_refused(self, error: Exception) -> None:
        if self.down_reason is None and not isinstance(error, CapacityError):
            log.warning("a decode burst was refused: %s", error)

    def _next_burst(self, batch: list[_Planned], results: list[StepResult],
                    planned: frozenset[str] | None = None) -> list[_Planned]:
        """The plans of the burst that follows this one at once, when the next pass would run just that: one cohort,
        no generation waiting to join it (or back from sitting out), and with drafters, a plan in which nobody drafts
        that still holds for these sessions (BudgetPlanner.holds) or was made for them while this burst ran
        (`planned`, `_plan_ahead`). Generations that finished or left, or whose readers are behind, are not in it;
        empty when the loop must plan a pass."""
        if len(self.wakeups) > 1 or self.down_reason is not None:
            return []
        going_on = self._going_on(batch, results)
        leaving = {plan.stepper.session_id for plan, result in zip(batch, results) if result.finished}
        stepping = {plan.stepper.session_id for plan in going_on} | leaving
        if any(stepper.session_id not in stepping for stepper in self._ready()):
            return []  # NOTE: a generation joins, or has room again: the next pass plans it
        if self.drafters is None:
            return [_Planned(plan.stepper, 0) for plan in going_on]
        steppers = [plan.stepper for plan in going_on]
        opening = self._opening(steppers)
        offering = self._offering(steppers, opening)
        if not (planned is not None and offering <= planned or self.planner.holds(offering)):
            return []
        return [_Planned(stepper, 0, opening=stepper.session_id in opening) for stepper in steppers]

    def _going_on(self, batch: list[_Planned], results: list[StepResult]) -> list[_Planned]:
        """The plans of `batch` whose generations step on after `results`, before these are handed on: not finished,
        not gone, their readers not behind."""
        return [plan for plan, result in zip(batch, results) if not result.finished
                and self.steppers.get(plan.stepper.session_id) is plan.stepper and plan.stepper.sink.has_room()]

    async def _engine_call(self, fn: Callable[..., list[StepResult]], *args, forwards: int = 1) -> list[StepResult]:
        """fn(*args) on the engine; `last_call_seconds` its wall time, `last_run_seconds` the engine's time on it
        alone (what the cost model learns: a step queued behind another session's prefill chunk waits tens of
        milliseconds, which made plain steps measured while sessions joined look dearer than trees measured
        later, and the planner then drafted at every step). NOTE: inline only when the loop has had a turn since
        the last events went out (a draft round, or idling): otherwise their readers and the stream writers run
        beside the GPU, the step on the engine thread."""
        call: Callable = self.worker.call if self.streaming else self.worker.step_call
        step_started = self._engine_started()
        return self._engine_ended(step_started, await call(self.clock.timed, fn, *args), forwards)

    def _engine_submit(self, fn: Callable[..., list[StepResult]], *args, forwards: int = 1
                       ) -> Awaitable[list[StepResult]]:
        """`_engine_call`, queued on the engine thread now: the loop goes on with other work until it awaits it."""
        step_started = self._engine_started()
        pending = self.worker.submit(self.clock.timed, fn, *args)

        async def ended() -> list[StepResult]:
            return self._engine_ended(step_started, await pending, forwards)
        return ended()

    def _engine_started(self) -> float:
        if self.busy_since is None:
            self.busy_mark = self.worker.busy_seconds
        return time.perf_counter()

    def _engine_ended(self, step_started: float, timed: tuple[list[StepResult], float], forwards: int
                      ) -> list[StepResult]:
        """An engine call's results, its times kept (see `_engine_call`)."""
        results, self.last_run_seconds = timed
        ended = time.perf_counter()
        if self.busy_since is not None:
            self.metrics.step_gap_seconds.observe(step_started - self.busy_since)
        if self.clock.enabled:  # NOTE: the call's wall time runs from the last one's end while sessions step
            others_s = max(0.0, self.worker.busy_seconds - self.busy_mark - self.last_run_seconds)
            since = step_started if self.busy_since is None else self.busy_since
            self.clocked.append((ended - since - others_s, forwards))
            self._observe_gpu()
        self.busy_since, self.last_call_seconds = ended, ended - step_started
        self.busy_mark = self.worker.busy_seconds
        return results

    def _observe_gpu(self) -> None:
        """The GPU's time per forward of the engine calls that have ended on it, and the rest of their wall time:
        the host's share of a step (the loop's work, the drafts, the engine's host work)."""
        for gpu_s in self.clock.finished():
            wall_s, forwards = self.clocked.popleft()
            self.metrics.engine_gpu_seconds.observe(gpu_s / forwards)
            self.metrics.step_host_overhead_seconds.observe(max(wall_s - gpu_s, 0.0) / forwards)

    def _deliver_all(self, batch: list[_Planned], results: list[StepResult], started: float, drafted: float) -> None:
        ended = time.perf_counter()
        for plan, result in zip(batch, results):
            self._deliver(plan, result, started, drafted, ended)
        self.deliveries += 1
        self.streaming = True
        asyncio.get_running_loop().call_soon(self._streamed, self.deliveries)

    def _streamed(self, delivery: int) -> None:
        """The loop had a turn after the events of delivery number `delivery` went out."""
        if delivery == self.deliveries:
            self.streaming = False

    def _deliver(self, plan: _Planned, result: StepResult, started: float, drafted: float, ended: float) -> None:
        stepper = plan.stepper
        if self.steppers.get(stepper.session_id) is not stepper:
            return  # NOTE: its generation left during the step
        try:
            event = self._step_event(plan, result, started, drafted, ended)
            if result.finished:
                self._drop(stepper)  # NOTE: before the next pass, which must not step a finished generation
            stepper.deliver(event)
        except Exception as error:  # noqa: BLE001 - what fails in one generation's hand-over ends it alone
            log.exception("session %s: its step could not be handed on", stepper.session_id)
            self._drop(stepper)
            stepper.fail(error)

    def _step_event(self, plan: _Planned, result: StepResult, started: float, drafted: float,
                    ended: float) -> StepEvent:
        """The step's event, with what it teaches the metrics, the costs and the generation's budget policy."""
        stepper, budget, tree = plan.stepper, plan.budget, plan.tree
        self.metrics.step_seconds.observe(ended - drafted)
        if stepper.cursor.step and self.drafters is not None and not plan.opening:
            self.metrics.tree_budget.observe(budget)
        if tree is not None and budget and not plan.seeding:  # NOTE: opening a mirror is no cost of its steps
            self.costs.observe_draft(budget, stepper.session.kv_len, drafted - started)
        if not plan.opening:  # NOTE: its policy chose nothing: its mirror was opening
            stepper.budgets.observe(budget, tree, result.path)
            stepper.budgets.observe_plain(len(result.emitted) - result.acceptance_length)  # NOTE: a burst's steps
        event = StepEvent(stepper.cursor.step, result, len(tree) if tree else 0, drafted - started, ended - drafted)
        stepper.cursor.advance(result.committed, result.features, result.commit_start, drafted=budget > 0)
        return event

    def _observe_batch(self, steps: list[tuple[str, DraftTree]], results: list[StepResult], seconds: float) -> None:
        """A verify batch's metrics and costs, once per batch: per session they cost the loop ~20% of a plain
        session-step (benchmarks/results/verifier_loop.md). `seconds`: per forward (a burst runs several)."""
        metrics = self.metrics
        metrics.batch_sessions.observe(len(steps))
        metrics.batch_seconds.observe(seconds)
        metrics.steps.inc(len(steps))
        metrics.drafted.inc(sum(len(tree) for _, tree in steps))
        metrics.accepted.inc(sum(len(result.accepted) for result in results))
        for result in results:
            metrics.acceptance.observe(result.acceptance_length)
        shape = BatchShape(len(steps), sum(len(tree) + 1 for _, tree in steps))
        sessions = [self.engine.sessions.get(session_id) for session_id, _ in steps]
        context = sum(session.kv_len for session in sessions if session) // len(steps)
        self.costs.observe_batch(shape, context, seconds)
