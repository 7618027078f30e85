"""The step loop: every stepping session in every pass, one draft round per pass, batches split by the engine's
limits in joining order, a failed step isolated to its session, a slow consumer sitting passes out, a generation
that leaves never stepped again, and exact outputs through the real engine."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest

from modeling.speculation import DraftStep
from modeling.tree import DraftTree
from tests.engine_helpers import GREEDY, make_engine, plain_generate
from verifier_service.budget_planner import HOLD_PASSES
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import StepResult
from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.stopping import StopReason
from verifier_service.errors import EngineDown, InvalidArgument, SessionNotFound
from verifier_service.gpu_clock import GpuClock
from verifier_service.metrics import VerifierMetrics
from verifier_service.service import VerifierService
from verifier_service.step_costs import BatchShape, StepCosts
from verifier_service.step_loop import RUN_AHEAD, StepEvent, StepLoop
from verifier_service.tree_budget import FixedBudget, Offer
from verifier_service.worker import EngineWorker

PROMPT = list(b"one loop steps them all")


@dataclass
class FakeSession:
    session_id: str
    kv_len: int = 8
    root: int = 1


@dataclass
class FakeModelConfig:
    vocab_size: int = 256


@dataclass
class FakeEngine:
    """Steps sessions for `lengths[session]` steps each; records every batch's session ids and thread."""

    lengths: dict[str, int]
    config: EngineConfig = field(default_factory=EngineConfig)
    model_config: FakeModelConfig = field(default_factory=FakeModelConfig)
    batches: list[list[str]] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    failing: str | None = None  # a session whose every step the engine refuses
    unburstable: str | None = None  # a session for which the engine refuses bursts
    step_seconds: float = 0.0  # how long each step keeps the engine (the GPU) busy
    spans: list[tuple[float, float]] = field(default_factory=list)  # each step's (start, end)
    bursts_queued: int = 0  # bursts the loop has asked for (burst_length is asked as each is queued)
    bursts_wanted: list[tuple[int, int]] = field(default_factory=list)  # (steps done by then, steps wanted) each

    def __post_init__(self) -> None:
        self.sessions = {sid: FakeSession(sid) for sid in self.lengths}
        self.done = dict.fromkeys(self.lengths, 0)

    def step(self, work: list[tuple[str, DraftTree]]) -> list[StepResult]:
        if self.failing in [sid for sid, _ in work]:
            raise InvalidArgument(f"session {self.failing}: refused")
        self.batches.append([sid for sid, _ in work])
        self.threads.append(threading.get_ident())
        started = time.perf_counter()
        time.sleep(self.step_seconds)
        self.spans.append((started, time.perf_counter()))
        results = []
        for sid, _ in work:
            self.done[sid] += 1
            finished = StopReason.LENGTH if self.done[sid] == self.lengths[sid] else None
            results.append(StepResult(sid, [], [], [7], 0, [7], None, finished))
        return results

    def burst_length(self, session_ids: list[str], wanted: int) -> int:
        if self.unburstable in session_ids:
            raise SessionNotFound(f"session {self.unburstable}: released")
        self.bursts_queued += 1
        self.bursts_wanted.append((self.done[session_ids[0]], wanted))
        return wanted

    def decode(self, session_ids: list[str], steps: int) -> list[StepResult]:
        """One step of the sessions standing for `steps` (the fake's steps carry one token each)."""
        return self.step([(sid, DraftTree.empty()) for sid in session_ids])


class OpenDrafters:
    """A drafter pool whose mirrors are all open: what the loop asks of one besides its drafts."""

    def is_open(self, session_id: str) -> bool:
        return True

    def opening(self, session_id: str) -> bool:
        return False

    def add_features(self, session_id: str, features) -> None:
        pass


class ChainDrafters(OpenDrafters):
    """A drafter pool that answers every step at once with a chain of the session's size."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes, self.rounds = sizes, []

    async def draft_all(self, steps: list[DraftStep]) -> list[DraftTree]:
        self.rounds.append(sorted(step.session_id for step in steps))
        return [DraftTree.chain([3] * self.sizes[step.session_id]) for step in steps]


def run_loop(engine: FakeEngine, drafters: ChainDrafters | None, consume, cohorts: int = 1,
             costs: StepCosts | None = None, prefilling=lambda: False) -> VerifierMetrics:
    """Start a loop over `engine`, run `consume(loop)`, stop the loop; returns its metrics."""
    metrics = VerifierMetrics()

    async def main() -> None:
        worker = EngineWorker()
        loop = StepLoop(engine, worker, drafters, metrics, costs or StepCosts(), cohorts, prefilling)
        loop.start()
        try:
            await consume(loop)
        finally:
            await loop.stop()
            worker.shutdown()

    asyncio.run(main())
    return metrics


async def read_all(loop: StepLoop, session: FakeSession, budget: int = 15) -> list:
    return [event async for event in loop.steps(session, FixedBudget(budget))]


def test_every_stepping_session_is_in_every_step_and_drafts_in_one_round() -> None:
    engine = FakeEngine({f"s{i}": 5 for i in range(6)})
    drafters = ChainDrafters(dict.fromkeys(engine.lengths, 3))

    async def consume(loop: StepLoop) -> None:
        events = await asyncio.gather(*(read_all(loop, session) for session in engine.sessions.values()))
        assert [len(e) for e in events] == [5] * 6 and all(e[-1].result.finished for e in events)
        assert [event.step for event in events[0]] == list(range(5))
        assert [event.drafted_nodes for event in events[0]] == [0, 3, 3, 3, 3]  # the first step drafts nothing

    run_loop(engine, drafters, consume)
    assert engine.batches == [sorted(engine.lengths)] * 5
    assert drafters.rounds == [sorted(engine.lengths)] * 4


class SlowDrafters(ChainDrafters):
    """Each round takes `seconds` (a drafter process at work); records its (start, end)."""

    def __init__(self, sizes: dict[str, int], seconds: float):
        super().__init__(sizes)
        self.seconds, self.spans = seconds, []

    async def draft_all(self, steps: list[DraftStep]) -> list[DraftTree]:
        started = time.perf_counter()
        await asyncio.sleep(self.seconds)
        self.spans.append((started, time.perf_counter()))
        return await super().draft_all(steps)


def test_cohorts_step_in_turn_and_one_drafts_while_another_steps() -> None:
    """Two cohorts: each engine step holds one cohort's sessions (each joined the smaller cohort), every session
    steps to its end, and draft rounds run while the other cohort's steps keep the engine busy."""
    engine = FakeEngine({f"s{i}": 6 for i in range(4)}, step_seconds=0.02)
    drafters = SlowDrafters(dict.fromkeys(engine.lengths, 3), seconds=0.02)

    async def consume(loop: StepLoop) -> None:
        events = await asyncio.gather(*(read_all(loop, session) for session in engine.sessions.values()))
        assert [len(e) for e in events] == [6] * 4
        # NOTE: what each cohort's passes keep the engine busy with, which hides the other's drafts in its plan
        assert all(seconds >= 0.015 for seconds in loop.cohort_step_seconds)

    run_loop(engine, drafters, consume, cohorts=2)
    assert {tuple(batch) for batch in engine.batches} == {("s0", "s2"), ("s1", "s3")}
    overlapping = [(d, e) for d in drafters.spans for e in engine.spans if d[0] < e[1] - 0.005 and e[0] < d[1] - 0.005]
    assert len(overlapping) >= len(drafters.spans) // 2


def histogram_count_and_sum(histogram) -> tuple[float, float]:
    samples = histogram.collect()[0].samples
    return tuple(next(sample.value for sample in samples if sample.name.endswith(suffix))
                 for suffix in ("_count", "_sum"))


def test_a_passs_host_work_is_measured_apart_from_its_engine_calls_and_draft_round() -> None:
    """What a pass spends outside the engine and the draft round is the loop's own work: 50 ms steps and 50 ms
    draft rounds leave a few milliseconds of it per pass, per drafting pass and per plain step of a burst."""
    engine = FakeEngine({"drafting": 4, "plain": 9}, EngineConfig(decode_burst_steps=4), step_seconds=0.05)
    drafters = SlowDrafters({"drafting": 3, "plain": 0}, seconds=0.05)

    async def consume(loop: StepLoop) -> None:
        await read_all(loop, engine.sessions["drafting"], 3)
        await read_all(loop, engine.sessions["plain"], 0)

    costs = StepCosts()
    metrics = run_loop(engine, drafters, consume, costs=costs)
    drafting_passes, drafting_s = histogram_count_and_sum(metrics.drafting_pass_host_seconds)
    plain_steps, plain_s = histogram_count_and_sum(metrics.plain_step_host_seconds)
    assert drafting_passes == 3 and plain_steps >= 2  # NOTE: the drafting session's steps after its first
    assert 0 <= drafting_s / drafting_passes < 0.04 and 0 <= plain_s / plain_steps < 0.04
    # NOTE: the budget planner is taught the same, per kind of pass
    assert costs.pass_host[True].weight > 2.5 and 0 < costs.pass_host_s(True) < 0.04
    assert costs.pass_host[False].weight > 1.5 and 0 < costs.pass_host_s(False) < 0.04


def test_the_cost_model_learns_a_steps_own_time_not_its_wait_behind_other_engine_work() -> None:
    """A step queued behind another session's prefill chunk (here a 0.3 s call on the engine thread) waits for it:
    the step's cost is what the engine spent on it, or the plain steps measured while sessions join look dearer
    than the trees measured later, and the planner drafts at every step."""
    engine = FakeEngine({"s": 2}, EngineConfig(decode_burst_steps=1), step_seconds=0.01)
    costs = StepCosts()

    async def consume(loop: StepLoop) -> None:
        prefill = asyncio.ensure_future(loop.worker.call(time.sleep, 0.3))
        await asyncio.sleep(0.01)
        started = time.perf_counter()
        await read_all(loop, engine.sessions["s"], 0)
        assert time.perf_counter() - started > 0.25  # NOTE: the first step did wait behind the chunk
        await prefill

    run_loop(engine, None, consume, costs=costs)
    measured = [cell.seconds.value for row in costs.verify.rows.values() for cell in row.values()]
    assert measured and max(measured) < 0.06  # NOTE: 0.14 when the wait counts


def test_each_engine_calls_gpu_time_and_the_hosts_share_of_its_steps_are_measured(monkeypatch) -> None:
    """With a GPU clock (here the wall clock standing in for CUDA events), every engine call's GPU time is observed
    per forward, and the rest of its wall time from the call before, less other engine calls in between: a burst
    of 4 plain steps counts 4 forwards."""
    class WallEvent:
        def record(self) -> None:
            self.at = time.perf_counter()

        def query(self) -> bool:
            return True

        def elapsed_time(self, end: WallEvent) -> float:
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(GpuClock, "for_device", staticmethod(lambda device: GpuClock(WallEvent)))

    def measured(burst: int, others: int = 0) -> tuple[int, float, float]:
        """(engine calls, GPU s and host s per forward) of 9 tokens; each fake call takes 10 ms, a burst too;
        `others`: engine calls of 50 ms by someone else (prefill chunks, say) while the session steps."""
        engine = FakeEngine({"s": 9}, EngineConfig(decode_burst_steps=burst), step_seconds=0.01)

        async def consume(loop: StepLoop) -> None:
            stepping = asyncio.ensure_future(read_all(loop, engine.sessions["s"], 0))
            for _ in range(others):
                await asyncio.sleep(0.015)
                await loop.worker.call(time.sleep, 0.05)
            assert not others or not stepping.done()  # NOTE: the other calls ran between the session's steps
            await stepping

        metrics = run_loop(engine, None, consume)
        calls, gpu_s = histogram_count_and_sum(metrics.engine_gpu_seconds)
        _, host_s = histogram_count_and_sum(metrics.step_host_overhead_seconds)
        assert calls == len(engine.batches)
        return int(calls), gpu_s / calls, host_s / calls

    calls, gpu_s, host_s = measured(1)
    assert calls == 9 and 0.009 < gpu_s < 0.05 and 0 <= host_s < 0.05
    _, burst_gpu_s, _ = measured(4)
    assert burst_gpu_s < gpu_s / 2  # NOTE: the first step alone (10 ms), then bursts: 10 ms over 4 forwards
    _, _, host_s = measured(1, others=3)
    assert host_s < 0.01  # NOTE: the others' engine time is not the host's: 0.017 s a forward when it counts


class OpeningDrafters(ChainDrafters):
    """A pool whose sessions' mirrors open at their first draft round (a seed goes with it), or, with `acked`, are
    being opened for each session's first `acked` passes (the replica acknowledges its Open after them)."""

    def __init__(self, sizes: dict[str, int], acked: int = 0):
        super().__init__(sizes)
        self.opened: set[str] = set()
        self.waits = dict.fromkeys(sizes, acked)

    def is_open(self, session_id: str) -> bool:
        return session_id in self.opened or self.waits[session_id] > 0

    def opening(self, session_id: str) -> bool:
        self.waits[session_id] -= 1  # NOTE: asked once per pass that would plan the session
        return self.waits[session_id] >= 0

    async def draft_all(self, steps: list[DraftStep]) -> list[DraftTree]:
        self.opened.update(step.session_id for step in steps)
        return await super().draft_all(steps)


def test_a_generations_first_draft_round_counts_as_a_seed_not_a_draft_round() -> None:
    """The round that opens a session's mirror carries its seed (tenths of a second for a DFlash drafter of an 8B
    target): it goes to its own histogram, not into the steady rounds' mean."""
    engine = FakeEngine({"a": 5, "b": 5})
    drafters = OpeningDrafters({"a": 2, "b": 2})

    async def consume(loop: StepLoop) -> None:
        await asyncio.gather(*(read_all(loop, session) for session in engine.sessions.values()))

    metrics = run_loop(engine, drafters, consume)
    assert histogram_count_and_sum(metrics.seed_seconds)[0] == 1  # a and b open in the same round
    assert histogram_count_and_sum(metrics.draft_round_seconds)[0] == len(drafters.rounds) - 1


def test_a_session_whose_mirror_is_opening_steps_without_drafts_until_it_is_open() -> None:
    """A seed sent ahead of the drafts (its replica acknowledges Opens) costs the session no stall: it steps plainly
    until the replica says the mirror is open, then drafts; the other session drafts meanwhile."""
    engine = FakeEngine({"opening": 8, "open": 8})
    drafters = OpeningDrafters({"opening": 2, "open": 2})
    drafters.waits["opening"] = 3

    async def consume(loop: StepLoop) -> None:
        events = dict(zip(("opening", "open"), await asyncio.gather(
            read_all(loop, engine.sessions["opening"]), read_all(loop, engine.sessions["open"]))))
        assert [event.drafted_nodes for event in events["opening"]][:4] == [0, 0, 0, 2]  # 3 passes opening
        assert [event.drafted_nodes for event in events["open"]][:2] == [0, 2]

    run_loop(engine, drafters, consume)


def test_an_overload_is_split_over_engine_steps_in_joining_order() -> None:
    """More rows or sessions than one engine step takes go in several steps of one pass, the earliest-joined
    first; every step is answered, none is refused."""
    sizes = dict(zip([f"s{i}" for i in range(8)], [15, 15, 15, 3, 3, 3, 15, 0]))
    limits = EngineConfig(max_batch_tokens=40, max_batch_sessions=3, max_tree_nodes=15)
    engine = FakeEngine(dict.fromkeys(sizes, 2), limits)

    async def consume(loop: StepLoop) -> None:
        await asyncio.gather(*(read_all(loop, session) for session in engine.sessions.values()))

    run_loop(engine, ChainDrafters(sizes), consume)
    first_pass, second_pass = engine.batches[:3], engine.batches[3:]
    assert first_pass == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6", "s7"]]  # no drafts: 3 sessions a step
    assert second_pass == [["s0", "s1"], ["s2", "s3", "s4"], ["s5", "s6", "s7"]]  # 32 of 40 rows, then 3 sessions


def test_a_refused_burst_fails_no_one_and_the_batch_steps_instead() -> None:
    """A burst the engine refuses (a session of it released meanwhile, say) is an optimisation lost, not an
    error: the batch steps one step at a time instead."""
    engine = FakeEngine({"a": 4, "b": 4}, EngineConfig(decode_burst_steps=2), unburstable="b")

    async def consume(loop: StepLoop) -> None:
        events = await asyncio.gather(read_all(loop, engine.sessions["a"], 0), read_all(loop, engine.sessions["b"], 0))
        assert [len(e) for e in events] == [4, 4] and all(e[-1].result.finished for e in events)

    run_loop(engine, None, consume)


def test_a_refused_step_fails_its_own_generation_and_no_other() -> None:
    engine = FakeEngine({"good": 4, "bad": 4}, failing="bad")

    async def consume(loop: StepLoop) -> None:
        good, bad = await asyncio.gather(read_all(loop, engine.sessions["good"]),
                                         read_all(loop, engine.sessions["bad"]), return_exceptions=True)
        assert len(good) == 4 and isinstance(bad, InvalidArgument)

    run_loop(engine, None, consume)
    assert engine.batches == [["good"]] * 4


def test_a_consumer_that_stops_reading_sits_passes_out_and_holds_no_one_up() -> None:
    engine = FakeEngine({"reader": 20, "stalled": 20})

    async def consume(loop: StepLoop) -> None:
        stalled = loop.steps(engine.sessions["stalled"], FixedBudget(0))
        await anext(stalled)  # NOTE: then reads no more
        assert len(await read_all(loop, engine.sessions["reader"])) == 20
        await stalled.aclose()

    run_loop(engine, None, consume)
    stepped = sum("stalled" in batch for batch in engine.batches)
    assert stepped <= 1 + RUN_AHEAD + 1 and sum("reader" in batch for batch in engine.batches) == 20


def test_the_step_runs_on_the_engine_thread_while_a_consumer_has_an_event_to_stream() -> None:
    """The first step finds no consumer waiting and runs on the loop; the next starts right after it, before the
    consumer took its event, so it runs on the engine thread while the consumer streams."""
    engine = FakeEngine({"a": 2})

    async def consume(loop: StepLoop) -> None:
        await read_all(loop, engine.sessions["a"])

    run_loop(engine, None, consume)
    assert engine.threads[0] == threading.get_ident() != engine.threads[1]


def test_the_time_between_steps_is_measured_while_sessions_step_and_not_across_idle_time() -> None:
    engine = FakeEngine({"a": 3, "b": 1})

    async def consume(loop: StepLoop) -> None:
        await read_all(loop, engine.sessions["a"])
        await asyncio.sleep(0.1)  # the engine idles
        await read_all(loop, engine.sessions["b"])

    count, total = histogram_count_and_sum(run_loop(engine, None, consume).step_gap_seconds)
    assert count == 2 and total < 0.1  # between a's three steps; none across the idle time before b's


@pytest.mark.parametrize("burst", [1, 4])
def test_generations_through_the_loop_stay_exact_and_one_that_leaves_is_not_stepped_again(tiny_target,
                                                                                         burst: int) -> None:
    """Four sessions generate together (fp32 on the CPU: each equals plain decoding), one step or a burst of
    plain steps per engine call; a fifth is cancelled mid-generation: its session is released and no later step
    names it."""
    engine = make_engine(tiny_target, decode_burst_steps=burst)
    batches: list[list[str]] = []
    step, decode = engine.step, engine.decode
    engine.step = lambda work: batches.append([sid for sid, _ in work]) or step(work)
    engine.decode = lambda ids, steps: batches.append(list(ids)) or decode(ids, steps)
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:], list(b"another prompt")]

    async def main() -> tuple[list[list[int]], str]:
        service = VerifierService(engine, None, VerifierMetrics())
        await service.start()

        async def generate(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
            session = await service.create_session(prompt)
            return [t async for e in service.generate(session.session_id, [], params, False)
                    if isinstance(e, StepEvent) for t in e.result.emitted]

        leaving = await service.create_session(PROMPT)
        steps = service.generate(leaving.session_id, [], GREEDY, False)
        await anext(steps)
        outputs = asyncio.gather(*(generate(prompt) for prompt in prompts))
        await asyncio.sleep(0.05)
        await steps.aclose()
        outputs = await outputs
        await service.stop()
        return outputs, leaving.session_id

    outputs, left = asyncio.run(main())
    assert outputs == [plain_generate(engine, prompt) for prompt in prompts]
    last = max(i for i, batch in enumerate(batches) if left in batch)
    assert any(len(batch) > 1 for batch in batches[last + 1:])
    assert not engine.sessions and engine.pool.num_free == engine.pool.num_pages



def test_plain_batches_decode_in_bursts_and_stay_exact(tiny_target) -> None:
    """With decode bursts, sessions decoding plainly together get several tokens per event after their first
    (which stays alone: the first token must not wait), and every output equals plain decoding."""
    engine = make_engine(tiny_target, decode_burst_steps=4)
    prompts = [PROMPT, PROMPT[:9], list(b"another prompt")]
    params = [GREEDY, SamplingParams(max_new_tokens=13, ignore_eos=True), GREEDY]

    async def main() -> list[list[StepEvent]]:
        service = VerifierService(engine, None, VerifierMetrics())
        await service.start()

        async def generate(prompt: list[int], params: SamplingParams) -> list[StepEvent]:
            session = await service.create_session(prompt)
            return [e async for e in service.generate(session.session_id, [], params, False)
                    if isinstance(e, StepEvent)]

        events = await asyncio.gather(*(generate(p, q) for p, q in zip(prompts, params)))
        await service.stop()
        return events

    events = asyncio.run(main())
    for prompt, q, generation in zip(prompts, params, events):
        assert [t for e in generation for t in e.result.emitted] == plain_generate(engine, prompt, q)
        assert len(generation[0].result.emitted) == 1 and max(len(e.result.emitted) for e in generation) == 4
    assert len(events[1]) < 13


class BudgetChains(OpenDrafters):
    """A drafter pool that answers each step with a chain of its budget's size: of the session's true continuation
    where `truth` has it, else of a token the model seldom picks."""

    def __init__(self, truth: dict[str, list[int]] | None = None):
        self.truth = truth or {}

    async def draft_all(self, steps: list[DraftStep]) -> list[DraftTree]:
        trees = []
        for step in steps:
            truth = self.truth.get(step.session_id)
            done = step.position + len(step.committed) - len(PROMPT)  # NOTE: tokens generated before the root
            trees.append(DraftTree.chain(truth[done + 1:][:step.budget] if truth else [3] * step.budget))
        return trees


def run_drafting_beside_plain(tiny_target, truthful: bool, cohorts: int = 1) -> list[list[StepEvent]]:
    """PROMPT drafting (budget 5) beside three sessions decoding plainly, with bursts of 4: each one's events, each
    output checked against plain decoding."""
    engine = make_engine(tiny_target, decode_burst_steps=4)
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:], list(b"another prompt")]
    expected = [plain_generate(engine, prompt) for prompt in prompts]
    sessions = [engine.create_session(prompt)[0] for prompt in prompts]
    for session in sessions:
        engine.start_generation(session.session_id, GREEDY)
    outputs: list = []

    async def consume(loop: StepLoop) -> None:
        outputs.extend(await asyncio.gather(*(read_all(loop, s, b) for s, b in zip(sessions, (5, 0, 0, 0)))))

    run_loop(engine, BudgetChains({sessions[0].session_id: expected[0]} if truthful else None), consume, cohorts)
    for want, events in zip(expected, outputs):
        assert [t for e in events for t in e.result.emitted] == want
    return outputs


def test_a_batch_whose_drafts_fail_goes_on_in_a_burst_after_its_tree_step(tiny_target) -> None:
    """A pass where one session drafts and no draft is accepted: the tree step's events go out, then the whole
    batch, the drafting session too, decodes a burst of the remaining steps; every output stays exact."""
    drafting, *plain = run_drafting_beside_plain(tiny_target, truthful=False)
    tree_steps = drafting[1::2]
    assert all(e.drafted_nodes == 5 and not e.result.accepted for e in tree_steps)
    assert all(e.drafted_nodes == 0 and len(e.result.emitted) == 3 for e in drafting[2:-1:2])
    assert all(max(len(e.result.emitted) for e in events) == 3 for events in plain)


def test_generations_in_two_cohorts_stay_exact(tiny_target) -> None:
    for truthful in (False, True):
        run_drafting_beside_plain(tiny_target, truthful, cohorts=2)


def test_a_batch_with_an_accepted_draft_holds_no_burst(tiny_target) -> None:
    """A draft that pays keeps its session drafting every pass: no burst holds it back, so the plain sessions
    beside it step one token a pass until it finishes."""
    drafting, *plain = run_drafting_beside_plain(tiny_target, truthful=True)
    assert all(e.drafted_nodes == 5 and e.result.accepted for e in drafting[1:-1])
    passes = len(drafting)
    assert all(len(e.result.emitted) == 1 for events in plain for e in events[:passes - 1])


class HeldSink:
    """A sink with room for `room` events."""

    def __init__(self, room: int = 1 << 30):
        self.events, self.room = [], room

    def put(self, event: StepEvent) -> None:
        self.events.append(event)

    def has_room(self) -> bool:
        return len(self.events) < self.room


def test_a_sink_gets_its_steps_from_the_loop_and_holds_its_generation_out_while_full() -> None:
    engine = FakeEngine({"held": 6, "free": 6, "bad": 6}, failing="bad")

    async def consume(loop: StepLoop) -> None:
        held, free = HeldSink(room=2), HeldSink()
        holding = asyncio.ensure_future(loop.run(engine.sessions["held"], FixedBudget(0), held))
        failing = asyncio.ensure_future(loop.run(engine.sessions["bad"], FixedBudget(0), HeldSink()))
        await loop.run(engine.sessions["free"], FixedBudget(0), free)  # NOTE: returns after its last step
        assert [event.step for event in free.events] == list(range(6)) and free.events[-1].result.finished
        assert len(held.events) == 2 and not holding.done()  # sits the passes out, holding no one up
        held.room = 6
        loop.wake()
        await holding
        assert [event.step for event in held.events] == list(range(6))
        assert isinstance(failing.exception(), InvalidArgument)

    run_loop(engine, None, consume)


class QueueWatchingSink(HeldSink):
    """A sink that notes, as each event is put, how many bursts the loop had queued on the engine by then."""

    def __init__(self, engine: FakeEngine, room: int = 1 << 30):
        super().__init__(room)
        self.engine, self.queued = engine, []

    def put(self, event: StepEvent) -> None:
        super().put(event)
        self.queued.append(self.engine.bursts_queued)


def test_the_next_burst_is_queued_before_the_last_ones_events_go_out() -> None:
    """While a batch would only burst again, its next burst goes to the engine before the last one's events are handed
    on (asynchronous scheduling): the GPU does not wait for the hand-over and the next pass. A generation that joins
    meanwhile ends the chain: the next pass takes it in. A reader that is behind gets at most one event more than
    its room (from the burst queued before its last event went out), then sits passes out."""
    engine = FakeEngine({"a": 6, "b": 6, "late": 3, "held": 6}, EngineConfig(decode_burst_steps=2),
                        step_seconds=0.002)

    async def consume(loop: StepLoop) -> None:
        a, b = QueueWatchingSink(engine), QueueWatchingSink(engine)
        await asyncio.gather(loop.run(engine.sessions["a"], FixedBudget(0), a),
                             loop.run(engine.sessions["b"], FixedBudget(0), b))
        # NOTE: the first step is no burst; from the first burst's events on, the next burst was already queued
        assert a.queued == b.queued == [0, 2, 3, 4, 5, 5]
        assert engine.batches == [["a", "b"]] * 6

        engine.batches.clear()
        held, late = HeldSink(room=2), HeldSink()
        holding = asyncio.ensure_future(loop.run(engine.sessions["held"], FixedBudget(0), held))
        for _ in range(3):
            await asyncio.sleep(0.01)
        await loop.run(engine.sessions["late"], FixedBudget(0), late)
        assert len(held.events) == 3 and not holding.done()  # NOTE: its room, and one burst queued before
        held.room = 6
        loop.wake()
        await holding
        assert [event.step for event in held.events] == list(range(6)) and len(late.events) == 3

    run_loop(engine, None, consume)


def test_while_a_prefill_is_under_way_a_burst_takes_about_one_of_its_chunks_time() -> None:
    """While a prefill is under way, the loop asks for bursts of the steps that cost about one of its chunks (the
    chunk queued behind a burst then waits about its own time): one before a chunk was measured, three where a
    chunk costs 3.5 steps; with no prefill under way, every step wanted."""
    engine = FakeEngine({"a": 30, "b": 30}, EngineConfig(decode_burst_steps=8))
    costs = StepCosts()
    costs.verify.estimate = lambda rows, context: 0.010  # NOTE: a step of the two sessions costs 10 ms

    def prefilling() -> bool:
        done = engine.done["a"]
        if done >= 10 and costs.prefill_chunk_s() is None:
            costs.observe_prefill_chunk(0.035)
        return done < 20

    async def consume(loop: StepLoop) -> None:
        await asyncio.gather(read_all(loop, engine.sessions["a"], 0), read_all(loop, engine.sessions["b"], 0))

    run_loop(engine, None, consume, costs=costs, prefilling=prefilling)
    expected = [(done, 1 if done < 10 else 3 if done < 20 else 8) for done, _ in engine.bursts_wanted]
    assert engine.bursts_wanted == expected
    assert {wanted for _, wanted in expected} == {1, 3, 8}


class NeverPays:
    """A budget policy whose drafts never pay, idle for long (its probes due only far ahead): its offers counted."""

    def __init__(self) -> None:
        self.offers = 0

    def offer(self, context: int) -> Offer:
        self.offers += 1
        return Offer(None, (0, 3), (0.0, 0.0), (0.0, 3.0), idle=100)

    def observe(self, budget: int, tree: DraftTree | None, path: list[int]) -> None:
        pass

    def observe_plain(self, steps: int) -> None:
        pass


def measured_loop_costs() -> StepCosts:
    """Costs as a loop of two sessions has measured them: verify rows and a draft round."""
    costs = StepCosts()
    for rows in (2, 4, 8, 16):
        costs.observe_batch(BatchShape(2, rows), 8, 0.001 * rows)
    costs.observe_draft(3, 8, 0.005)
    return costs


def test_a_plan_in_which_nobody_drafts_is_made_while_the_burst_before_its_pass_runs() -> None:
    """With drafters, an all-plain plan holds HOLD_PASSES passes; the pass after that plans again. That plan is made
    while the burst before it runs, so that pass's burst too is queued before the last one's events go out: the
    chain of bursts never stops for a plan in which nobody drafts."""
    engine = FakeEngine({"a": 14, "b": 14}, EngineConfig(decode_burst_steps=2), step_seconds=0.002)
    drafters = ChainDrafters({"a": 3, "b": 3})

    async def consume(loop: StepLoop) -> None:
        loop.planner.probe_share = 1e-9  # NOTE: no probe within the test
        policies, sinks = [NeverPays(), NeverPays()], [QueueWatchingSink(engine), QueueWatchingSink(engine)]
        await asyncio.gather(*(loop.run(engine.sessions[sid], policy, sink)
                               for sid, policy, sink in zip("ab", policies, sinks)))
        # NOTE: the first step is no burst; from the first burst's events on, the next burst was already queued
        assert sinks[0].queued == sinks[1].queued == [0, *range(2, 14), 13]
        # NOTE: a plan at the first burst's pass, then one ahead every HOLD_PASSES - 1 bursts (a plan made ahead
        # holds one pass less)
        assert [policy.offers for policy in policies] == [1 + 12 // (HOLD_PASSES - 1)] * 2

    run_loop(engine, drafters, consume, costs=measured_loop_costs())
    assert engine.batches == [["a", "b"]] * 14 and drafters.rounds == []


def test_a_policy_that_fails_while_its_plan_is_made_ahead_ends_its_own_generation_and_no_other() -> None:
    """A plan made ahead asks the same offers as a pass's plan: a policy that fails there ends its own generation
    while the burst it is in still runs; its result from that burst goes nowhere, and the others step on."""
    engine = FakeEngine({"odd": 14, "fine": 14}, EngineConfig(decode_burst_steps=2), step_seconds=0.002)

    class FailsAhead(NeverPays):
        def offer(self, context: int) -> Offer:
            if self.offers == 1:  # NOTE: the first offer is the pass's plan, the second the plan made ahead
                raise ZeroDivisionError("a policy bug")
            return super().offer(context)

    async def consume(loop: StepLoop) -> None:
        loop.planner.probe_share = 1e-9
        odd, fine = HeldSink(), HeldSink()
        failed, done = await asyncio.gather(loop.run(engine.sessions["odd"], FailsAhead(), odd),
                                            loop.run(engine.sessions["fine"], NeverPays(), fine),
                                            return_exceptions=True)
        assert isinstance(failed, ZeroDivisionError) and done is None
        assert len(fine.events) == 14
        assert len(odd.events) == 4  # NOTE: its first step and three bursts; the fourth ran as its offer failed

    run_loop(engine, ChainDrafters({"odd": 3, "fine": 3}), consume, costs=measured_loop_costs())


def test_the_burst_after_a_tree_step_whose_drafts_failed_is_queued_before_its_events_go_out() -> None:
    """A pass where one session drafts beside a plain one and no draft is accepted goes on in a burst; that burst
    goes to the engine before the tree step's events are handed on, so the GPU does not wait for the hand-over."""
    engine = FakeEngine({"drafting": 7, "plain": 7}, EngineConfig(decode_burst_steps=2), step_seconds=0.002)

    async def consume(loop: StepLoop) -> None:
        drafting, plain = QueueWatchingSink(engine), QueueWatchingSink(engine)
        await asyncio.gather(loop.run(engine.sessions["drafting"], FixedBudget(3), drafting),
                             loop.run(engine.sessions["plain"], FixedBudget(0), plain))
        # NOTE: the first step drafts nothing; each tree step's event went out after its burst was queued
        assert drafting.queued == plain.queued == [0, 1, 1, 2, 2, 3, 3]
        assert [event.drafted_nodes for event in drafting.events] == [0, 2, 0, 2, 0, 2, 0]

    run_loop(engine, ChainDrafters({"drafting": 2, "plain": 2}), consume)
    assert engine.batches == [["drafting", "plain"]] * 7


def test_a_sink_that_fails_ends_its_own_generation_and_no_other() -> None:
    engine = FakeEngine({"broken": 4, "fine": 4})

    class BrokenSink(HeldSink):
        def put(self, event: StepEvent) -> None:
            raise RuntimeError("the stream is gone")

    async def consume(loop: StepLoop) -> None:
        fine = HeldSink()
        broken, _ = await asyncio.gather(loop.run(engine.sessions["broken"], FixedBudget(0), BrokenSink()),
                                         loop.run(engine.sessions["fine"], FixedBudget(0), fine),
                                         return_exceptions=True)
        assert isinstance(broken, RuntimeError) and len(fine.events) == 4

    run_loop(engine, None, consume)
    assert engine.batches == [["broken", "fine"]] + [["fine"]] * 3


def test_a_budget_policy_that_fails_ends_its_own_generation_and_no_other() -> None:
    engine = FakeEngine({"odd": 4, "fine": 4})

    class Failing(FixedBudget):
        def offer(self, context: int) -> Offer:
            raise ZeroDivisionError("a policy bug")

    async def consume(loop: StepLoop) -> None:
        odd, fine = await asyncio.gather(read_failing(loop, engine.sessions["odd"]),
                                         loop.run(engine.sessions["fine"], FixedBudget(3), HeldSink()),
                                         return_exceptions=True)
        assert isinstance(odd, ZeroDivisionError) and fine is None

    async def read_failing(loop: StepLoop, session: FakeSession) -> list:
        return [event async for event in loop.steps(session, Failing(3))]

    run_loop(engine, ChainDrafters({"odd": 2, "fine": 2}), consume)
    assert engine.batches == [["odd", "fine"]] + [["fine"]] * 3  # the first step chooses nothing


def test_generations_still_stepping_when_the_loop_stops_fail_rather_than_hang() -> None:
    engine = FakeEngine({"long": 10**6})

    async def main() -> None:
        worker = EngineWorker()
        loop = StepLoop(engine, worker, None, VerifierMetrics(), StepCosts())
        loop.start()
        running = asyncio.ensure_future(loop.run(engine.sessions["long"], FixedBudget(0), HeldSink()))
        await asyncio.sleep(0.05)
        await loop.stop()
        worker.shutdown()
        assert isinstance(await asyncio.wait_for(asyncio.gather(running, return_exceptions=True), 1), list)
        assert isinstance(running.exception(), EngineDown)

    asyncio.run(main())
