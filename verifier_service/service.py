"""The verifier's domain behind gRPC: session operations, and generations (a prefill, then steps in the step loop),
with the engine on its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ddtree.progress import track
from modeling.speculation import feature_tail
from verifier_service.admission import DEFAULT_ADMISSION_TIMEOUT_S, KVAdmission
from verifier_service.drafter_pool import DrafterPool
from verifier_service.engine.engine import Engine
from verifier_service.engine.logprobs import TokenLogprob
from verifier_service.engine.prefill import Prefill
from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.session import Session
from verifier_service.errors import EngineDown, NoFreePages, SessionBusy
from verifier_service.gpu_clock import GpuClock
from verifier_service.leases import SessionLeases
from verifier_service.metrics import VerifierMetrics
from verifier_service.prefill_turns import PrefillTurns
from verifier_service.step_costs import StepCosts
from verifier_service.step_loop import StepEvent, StepLoop, StepSink
from verifier_service.tree_budget import (
    AdaptiveBudget,
    BudgetPolicy,
    BudgetPolicyName,
    ServiceRecord,
    session_policy,
)
from verifier_service.worker import EngineWorker

log = logging.getLogger(__name__)

T = TypeVar("T")


# NOTE: a lease renewed every second by the gateway; a dead gateway's sessions go after this long.
DEFAULT_LEASE_S = 30.0


@dataclass(frozen=True)
class PrefillEvent:
    """Between two chunks of a generation's prefill, and once it is in if the prefix cache held part of it: the
    tokens prefilled so far, of `total`, and of those the ones the cache held."""

    done: int
    total: int
    cached: int = 0


@dataclass(frozen=True)
class PromptLogprobsEvent:
    """After a generation's prefill, when asked for: the logprobs of its appended tokens, one each."""

    logprobs: list[TokenLogprob]


def _log_warm_up(warming: asyncio.Future) -> None:
    if warming.cancelled():
        return
    if warming.exception() is not None:
        log.error("capturing CUDA graphs failed: %r", warming.exception())
    else:
        log.info("captured %d CUDA graphs", warming.result())


class VerifierService:
    def __init__(self, engine: Engine, drafters: DrafterPool | None, metrics: VerifierMetrics,
                 tree_budget: int = 15, inline_steps: bool = True, lease_s: float = DEFAULT_LEASE_S,
                 budget_policy: BudgetPolicyName = "fixed", step_cohorts: int = 1,
                 admission_timeout_s: float = DEFAULT_ADMISSION_TIMEOUT_S):
        """tree_budget: the largest budget of a step; budget_policy: verifier_service/tree_budget.py.
        inline_steps: see EngineWorker (off for a tensor-parallel group). lease_s: see SessionLeases. step_cohorts:
        see StepLoop. admission_timeout_s: see KVAdmission."""
        self.engine, self.drafters, self.metrics, self.tree_budget = engine, drafters, metrics, tree_budget
        self.budget_policy = budget_policy
        self.step_costs = StepCosts()  # NOTE: shared: every session's steps measure the same engine
        self.budget_record = ServiceRecord()  # what the adaptive sessions' trees accepted, for new ones
        self.policies: dict[str, AdaptiveBudget] = {}  # adaptive sessions' policies, across their generations
        self.worker = EngineWorker(inline_steps, engine.config.device)
        self.prefill_turns = PrefillTurns()
        self.admission = KVAdmission(admission_timeout_s, metrics.admission_wait_seconds.observe)
        self.generating: set[str] = set()
        self.leases = SessionLeases(lease_s)
        self.background: set[asyncio.Task] = set()  # aborted prefills, releases of sessions whose caller went away
        self.reaper: asyncio.Task | None = None
        metrics.watch(engine, self.generating, lambda: self.admission.waiting, lambda: self.prefill_turns.waiting)
        self.loop = StepLoop(engine, self.worker, drafters, metrics, self.step_costs, step_cohorts,
                             prefilling=lambda: self.prefill_turns.under_way)
        self.chunk_clock = GpuClock.for_device(engine.config.device)  # the prefill chunks' GPU time, for the loop
        self.down_reason: str | None = None  # set once the engine is down: every engine call fails with it
        self.down_signal: asyncio.Future | None = None  # done once the engine is down; what engine calls race
        self.warming: asyncio.Future | None = None
        if drafters is not None:
            drafters.on_info = self._use_drafter_features

    def _use_drafter_features(self, info) -> None:
        layers = tuple(info.target_layer_ids)
        if layers == self.engine.feature_layers:
            return
        self.engine.feature_layers = layers
        self._warm_up()  # NOTE: graphs without these features return none: capture the ones that do

    def _warm_up(self) -> None:
        """Capture the engine's graphs for steps of this tree budget on the engine thread (requests queue
        behind it) rather than in the middle of the first steps."""
        capturing = functools.partial(track, task="capturing CUDA graphs", unit="graphs")
        self.warming = asyncio.ensure_future(self.worker.call(self.engine.warm_up, self.tree_budget + 1, capturing))
        self.warming.add_done_callback(_log_warm_up)

    async def start(self) -> None:
        """Connects the drafters first: a replica that answers now names the feature layers to capture."""
        self.loop.start()
        self.reaper = asyncio.create_task(self._reap_forever(), name="lease-reaper")
        if self.drafters is not None:
            await self.drafters.refresh()
            self.drafters.start()
        if self.warming is None:
            self._warm_up()
        await self.warming

    async def stop(self) -> None:
        if self.warming is not None:
            await asyncio.gather(self.warming, return_exceptions=True)
        if self.reaper is not None:
            self.reaper.cancel()
        await asyncio.gather(*self.background, *([self.reaper] if self.reaper else []), return_exceptions=True)
        await self.loop.stop()
        if self.drafters is not None:
            await self.drafters.stop()
        self.worker.shutdown()

    def fail(self, reason: str) -> None:
        """Mark the engine down: in-flight and later engine work fail with EngineDown at once, even while the
        engine thread is stuck (in a collective with a dead rank)."""
        self.down_reason = reason
        self.loop.fail(reason)
        if self.down_signal is not None and not self.down_signal.done():
            self.down_signal.set_result(None)


    async def _prefill(self, prefill: Prefill) -> AsyncIterator[PrefillEvent]:
        """A prefill one chunk per engine call: the verify steps queued meanwhile run between two chunks, so a
        128k-token prompt holds the other sessions up for one chunk at a time, not for all of it; concurrent
        prefills take turns shortest-remaining-first (PrefillTurns). It tells how far it got after each chunk but
        the last; the chunks run in a task of their own, so a caller slow to take that news holds up no other
        prefill. A caller that goes away (or an error) aborts it at the next chunk: a client gone during a long
        prompt frees the engine and the prompt's pages."""
        progress: asyncio.Queue[int] = asyncio.Queue()  # tokens prefilled after each chunk but the last
        chunks = asyncio.ensure_future(self._prefill_chunks(prefill, progress.put_nowait))
        news: asyncio.Future | None = None
        try:
            while True:
                news = asyncio.ensure_future(progress.get())
                await asyncio.wait((chunks, news), return_when=asyncio.FIRST_COMPLETED)
                if not news.done():
                    chunks.result()
                    self.metrics.observe_prefill(prefill.total, prefill.cached_tokens)
                    if prefill.cached_tokens:
                        yield PrefillEvent(prefill.done, prefill.total, prefill.cached_tokens)
                    return
                yield PrefillEvent(news.result(), prefill.total, prefill.cached_tokens)
        except BaseException:
            chunks.cancel()
            self._in_background(chunks)
            self._in_background(self._abort(prefill))
            raise
        finally:
            if news is not None:
                news.cancel()

    async def _prefill_chunks(self, prefill: Prefill, report: Callable[[int], None]) -> None:
        """The chunks in turns. The first one takes the prompt's pages; when they are not free it waits in the
        admission queue, as does a prompt that finds others waiting there already (and it reports 0 tokens done
        first: the caller learns that its request is in, and waits)."""
        queued = self.admission.waiting > 0
        while True:
            if queued:
                report(0)
                await self.admission.admit(lambda: self._call(prefill.reserve), f"the prompt's {prefill.pages_needed}")
            async with self.prefill_turns.turn(prefill.total) as between:
                try:
                    while not await self._chunk(prefill):
                        report(prefill.done)
                        await between(prefill.total - prefill.done)
                    return
                except NoFreePages:
                    queued = True

    async def _chunk(self, prefill: Prefill) -> bool:
        """The prefill's next chunk (Prefill.advance), its engine time learnt (StepCosts.prefill_chunk_s: how long
        the step loop's bursts may hold the next one up): the GPU's, read once its events have passed, else the
        engine thread's."""
        finished, host_s = await self._call(self.chunk_clock.timed, prefill.advance, self._prefill_chunk_now())
        for seconds in self.chunk_clock.finished() if self.chunk_clock.enabled else [host_s]:
            self.step_costs.observe_prefill_chunk(seconds)
        return finished

    def _prefill_chunk_now(self) -> int | None:
        """The lone prefill chunk (--lone-prefill-chunk) while nobody else waits for the engine: no generation
        stepping, no other prompt waiting for its turn or for pages; else None, the engine's own chunk."""
        lone = self.engine.config.lone_prefill_chunk
        if lone and not (self.loop.steppers or self.prefill_turns.waiting or self.admission.waiting):
            return lone
        return None

    async def _start_generation(self, session_id: str, params: SamplingParams) -> None:
        """Start the generation once the pages it may take are free: at once when its prefill kept them free
        (Engine.promised), else in the admission queue's order."""
        async def started() -> bool:
            try:
                await self._call(self.engine.start_generation, session_id, params)
            except NoFreePages:
                return False
            return True

        first = session_id in self.engine.promised or not self.admission.waiting
        if not (first and await started()):
            await self.admission.admit(started, "the generation's")

    async def _end_generation(self, session_id: str) -> None:
        await self._call(self.engine.end_generation, session_id)
        self.admission.pages_freed()

    async def _abort(self, prefill: Prefill) -> None:
        await self._call(prefill.abort)  # NOTE: behind a chunk still running on the engine thread
        self.admission.pages_freed()

    async def _call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the engine thread, or EngineDown as soon as the engine is marked down. (Verify
        steps go through the step loop, which fails them itself.)"""
        if self.down_reason is not None:
            raise EngineDown(self.down_reason)
        loop = asyncio.get_running_loop()
        if self.down_signal is None or self.down_signal.get_loop() is not loop:
            # NOTE: one future shared by every call: a task waiting on `down` per call cost more than a small step
            self.down_signal = loop.create_future()
        work, down = asyncio.ensure_future(self.worker.call(fn, *args, **kwargs)), self.down_signal
        try:
            done, _ = await asyncio.wait((work, down), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()  # NOTE: a cancelled step settles before we return, unless the engine goes down first
            await asyncio.wait((work, down), return_when=asyncio.FIRST_COMPLETED)
            raise
        if work in done:
            return work.result()
        work.cancel()
        raise EngineDown(self.down_reason)

    # ---- session operations --------------------------------------------------------------------------

    def _feature_tail(self) -> int:
        window = self.drafters.window if self.drafters else None
        return feature_tail(bool(self.engine.feature_layers), window, self.engine.max_context)

    async def create_session(self, prompt: list[int]) -> Session:
        """A new session of `prompt` (prefill_session, no prompt logprobs)."""
        session, _ = await self.prefill_session(prompt)
        return session

    async def prefill_session(self, prompt: list[int], prompt_logprobs: int | None = None
                              ) -> tuple[Session, list[TokenLogprob] | None]:
        """A new session of `prompt`; with `prompt_logprobs` (alternatives), the logprobs of its tokens but the first,
        from its own prefill."""
        prefill = await self._call(self.engine.begin_session, prompt, secrets.token_hex(8), self._feature_tail(),
                                   prompt_logprobs)
        session, features = prefill.session, None
        try:
            async for _ in self._prefill(prefill):
                pass
            features = prefill.features
        except asyncio.CancelledError:
            # NOTE: the last chunk may still finish on the engine thread; the release queues behind it there.
            self._in_background(self._release(session.session_id))
            raise
        self.leases.grant(session.session_id)
        if self.drafters is not None:
            self.drafters.attach(session.session_id, lambda: session.tokens[:-1], features)
        return session, prefill.logprobs

    def session(self, session_id: str) -> Session:
        return self.engine.session(session_id)

    async def fork_session(self, session_id: str) -> Session:
        self._check_idle(session_id)
        fork = await self._call(self.engine.fork_session, session_id)
        self.leases.grant(fork.session_id)
        if self.drafters is not None:
            features = self.drafters.features(session_id)
            self.drafters.attach(fork.session_id, lambda: fork.tokens[:-1], features)
        return fork

    def _budgets(self, session_id: str, pinned: int) -> BudgetPolicy:
        """The generation's budget policy. A session's adaptive policy outlives its generations: the next turn
        starts from what the last one learnt of the session's acceptance, not from exploring again."""
        policy = session_policy(self.budget_policy, self.tree_budget, pinned, self.step_costs, self.budget_record)
        return self.policies.setdefault(session_id, policy) if isinstance(policy, AdaptiveBudget) else policy

    async def release_session(self, session_id: str) -> int:
        self._check_idle(session_id)
        self.engine.session(session_id)
        free_before = self.engine.pool.num_free
        await self._unstoppable(self._release(session_id))  # NOTE: a caller's deadline must not leave it half done
        return self.engine.pool.num_free - free_before

    def renew_leases(self, session_ids: list[str]) -> list[str]:
        """Renew the sessions a gateway holds; returns the ids this verifier does not know."""
        return self.leases.renew(session_ids)

    async def _release(self, session_id: str) -> None:
        self.leases.drop(session_id)
        self.policies.pop(session_id, None)
        if self.drafters is not None:
            self.drafters.detach(session_id)
        await self._call(self.engine.release_session, session_id)
        self.admission.pages_freed()

    def _in_background(self, work: Awaitable) -> asyncio.Future:
        """Engine work that must happen though its caller is gone (awaited by `stop`)."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def _unstoppable(self, work: Awaitable[T]) -> T:
        """`work`, finished though this caller is cancelled meanwhile: a session's release or a generation's end
        (the release drops the session's lease first, so a release dropped half way would hold its pages for good)."""
        return await asyncio.shield(self._in_background(work))

    async def _reap_forever(self) -> None:
        """Release the sessions whose lease ran out (their gateway is gone or forgot them)."""
        while True:
            await asyncio.sleep(min(1.0, self.leases.lease_s / 4))
            for session_id in self.leases.expired(self.generating):
                log.info("session %s: lease expired, released", session_id)
                try:
                    await self._release(session_id)
                except Exception:  # noqa: BLE001 - the reaper must outlive one failed release
                    log.exception("releasing session %s failed", session_id)

    def _check_idle(self, session_id: str) -> None:
        if session_id in self.generating:
            raise SessionBusy("session: a generation is already running on it")

    # ---- generation ------------------------------------------------------------------------------------

    async def generate(self, session_id: str, append: list[int], params: SamplingParams, keep_session: bool,
                       tree_budget: int = 0, sink: StepSink | None = None, prompt_logprobs: int | None = None
                       ) -> AsyncIterator[PrefillEvent | PromptLogprobsEvent | StepEvent]:
        """The appended tokens' prefill progress (between its chunks, when it takes more than one), their logprobs
        when `prompt_logprobs` asks (and something was appended), then steps until a stop (into `sink` when given, else
        yielded); on cancellation or error the session is kept or released as asked. `tree_budget` pins the budget of
        every step (0: the server's policy).
        NOTE: appended tokens stay in the session even if generation fails afterwards."""
        self._check_idle(session_id)
        session = self.engine.session(session_id)
        self.generating.add(session_id)
        try:
            params.validate()
            budgets = self._budgets(session_id, tree_budget)
            if append:
                prefill = await self._call(self.engine.begin_extend, session_id, append, self._feature_tail(),
                                           params.max_new_tokens, prompt_logprobs)
                async with contextlib.aclosing(self._prefill(prefill)) as events:
                    async for event in events:
                        yield event
                features = prefill.features
                if self.drafters is not None:
                    self.drafters.add_features(session_id, features)
                if prefill.logprobs is not None:
                    yield PromptLogprobsEvent(prefill.logprobs)
            await self._start_generation(session_id, params)
            if self.drafters is not None and params.max_new_tokens > 1:  # NOTE: one token is the prefill's alone
                self.drafters.open_soon(session_id)  # NOTE: the seed travels while the first steps go without drafts
            if sink is not None:
                await self.loop.run(session, budgets, sink)
                return
            async with contextlib.aclosing(self.loop.steps(session, budgets)) as steps:
                async for event in steps:  # NOTE: closed before the release below, out of the loop by then
                    yield event
        finally:
            self.generating.discard(session_id)
            self.leases.grant(session_id)  # NOTE: the lease restarts when the generation lets go of it
            if self.drafters is not None:
                self.drafters.park(session_id)  # NOTE: a released session's mirror closes with it
            if self.down_reason is None:
                # NOTE: shielded: a second cancellation (a deadline, the stream's end) while the engine thread is
                # busy would otherwise drop the queued release, and the session, its lease gone, would hold its pages
                await self._unstoppable(self._end_generation(session_id) if keep_session else self._release(session_id))
