"""Batches the verify steps of concurrent sessions into one forward. Before a step it waits for every stepping
session to queue: one that is still streaming its last step or drafting its next tree joins this step instead of
starting the next one, so sessions step together rather than drifting into half-full batches that each read all
the weights. The wait lasts `batch_wait_s`, longer while steps keep arriving within `batch_wait_s` of each other
or while a stepping session waits for its draft, but never longer than the last step took: drafts of many sessions
trickle in one by one (a drafter serves them in turn), and waiting for the last of them pays while it costs less
than another step. A step takes at most the engine's max_batch_tokens rows and max_batch_sessions sessions, the
longest-waiting first; the rest wait for the next step, so an overload raises latency instead of failing steps."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from modeling.tree import DraftTree
from verifier_service.engine.engine import Engine, StepResult
from verifier_service.errors import EngineDown
from verifier_service.worker import EngineWorker

Step = tuple[str, DraftTree]  # a session and the tree its step verifies


@dataclass
class _Pending:
    session_id: str
    tree: DraftTree
    future: asyncio.Future


class StepBatcher:
    def __init__(self, engine: Engine, worker: EngineWorker, stepping: Callable[[], int],
                 observe: Callable[[list[Step], list[StepResult], float, float | None], None] = (
                     lambda steps, results, seconds, gap: None),
                 batch_wait_s: float = 0.005, drafting: Callable[[], int] = lambda: 0):
        """stepping: how many sessions are in their step loops (in a step, between steps, or queued here); observe:
        told each batch's steps, results, wall time and the time since the last step ended (None when no session
        was stepping then: an idle engine is no host overhead); batch_wait_s: the gap between arriving steps that ends a
        step's wait for the stepping sessions not queued yet (see the module's docstring); drafting: how many of
        them wait for a draft (no gap ends the wait for those: only the last step's time does)."""
        self.engine, self.worker, self.stepping, self.observe = engine, worker, stepping, observe
        self.drafting = drafting
        self.batch_wait_s = batch_wait_s
        self.queue: list[_Pending] = []
        self.queued_rows = 0  # NOTE: kept, not summed: every submit asks whether the queue holds a batch
        self.running: list[_Pending] = []  # the batch in the engine
        self.last_arrival = 0.0  # loop time of the latest submit
        self.last_step_s = 0.0  # wall time of the latest step
        self.busy_since: float | None = None  # when the latest step ended, while sessions were stepping
        self.down_reason: str | None = None
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="step-batcher")

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def fail(self, reason: str) -> None:
        """The engine is down: every queued and running step fails with EngineDown now (the engine thread may be
        stuck in a collective with a dead rank), and so does every later one."""
        self.down_reason = reason
        for pending in self.queue + self.running:
            if not pending.future.done():
                pending.future.set_exception(EngineDown(reason))
        self.queue, self.queued_rows = [], 0

    async def submit(self, session_id: str, tree: DraftTree) -> StepResult:
        if self.down_reason is not None:
            raise EngineDown(self.down_reason)
        pending = _Pending(session_id, tree, asyncio.get_running_loop().create_future())
        self.queue.append(pending)
        self.queued_rows += len(tree) + 1
        self.last_arrival = asyncio.get_running_loop().time()
        if len(self.queue) == 1 or self._gathered():  # NOTE: the first step starts a gather, the last ends it
            self.wakeup.set()
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            # NOTE: a cancelled caller must not leave a step for a session it is about to release:
            # either take it out of the queue or wait until the running step has finished with it.
            if pending in self.queue:
                self.queue.remove(pending)
                self.queued_rows -= len(tree) + 1
            else:
                await asyncio.gather(pending.future, return_exceptions=True)
            raise

    async def _run(self) -> None:
        while True:
            if not self.queue:
                await self.wakeup.wait()
            self.wakeup.clear()
            await self._gather()
            if self.queue:
                await self._step(self._take())

    async def _gather(self) -> None:
        """Wait until every stepping session is queued or the queue fills a batch, while steps keep arriving
        (within `batch_wait_s` of each other), for at most the last step's time (at least `batch_wait_s`)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        cap = start + max(self.batch_wait_s, self.last_step_s)
        while self.queue and not self._gathered():
            # NOTE: from the gather's start too: steps queued during the last step must not leave at once, or the
            # sessions of that step (about to queue again) would form a second batch of their own, every step
            # NOTE: a session that skips its draft queues a draft's round trip before the ones that wait for theirs:
            # the gap between them is no sign that the rest went elsewhere (an adaptive batch split in two by it)
            gap_end = max(start, self.last_arrival) + self.batch_wait_s
            left = (cap if self.drafting() else min(cap, gap_end)) - loop.time()
            if left <= 0:
                return
            self.wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), left)

    def _gathered(self) -> bool:
        """Every stepping session is queued, or the queue holds more than one batch."""
        config = self.engine.config
        return (len(self.queue) >= self.stepping() or len(self.queue) > config.max_batch_sessions
                or self.queued_rows > config.max_batch_tokens)

    def _fitting(self) -> int:
        """How many of the longest-waiting steps fit one batch (at least one: a step that fits nowhere goes alone
        and the engine refuses it)."""
        config, rows, taken = self.engine.config, 0, 0
        for pending in self.queue:
            size = len(pending.tree) + 1
            if taken and (rows + size > config.max_batch_tokens or taken == config.max_batch_sessions):
                break
            rows, taken = rows + size, taken + 1
        return taken

    def _take(self) -> list[_Pending]:
        taken = self._fitting()
        batch, self.queue = self.queue[:taken], self.queue[taken:]
        self.queued_rows -= sum(len(p.tree) + 1 for p in batch)
        return batch

    async def _step(self, batch: list[_Pending]) -> None:
        try:
            # NOTE: a session between steps needs the loop during this one (its draft round trip overlaps the
            # GPU work), so only a batch of every stepping session may run on the loop itself.
            call = self.worker.step_call if len(batch) >= self.stepping() else self.worker.call
            started = time.perf_counter()
            gap = None if self.busy_since is None else started - self.busy_since
            steps = [(p.session_id, p.tree) for p in batch]
            self.running = batch
            try:
                results = await call(self.engine.step, steps)
            finally:
                self.running = []
            ended = time.perf_counter()
            self.last_step_s = ended - started
            self.busy_since = ended if self.stepping() else None
            self.observe(steps, results, self.last_step_s, gap)
        except Exception as error:  # noqa: BLE001 - handed to the waiting caller
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(error)
                return
            # NOTE: the engine validates and reserves pages before it runs anything, so a failed batch
            # changed nothing; stepping the sessions one by one isolates the one at fault.
            for pending in batch:
                await self._step([pending])
            return
        for pending, result in zip(batch, results):
            if not pending.future.done():  # NOTE: failed meanwhile (the engine went down)
                pending.future.set_result(result)
