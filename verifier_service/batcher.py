"""Batches the verify steps of concurrent sessions: whatever is queued while a step runs goes into
the next one, so sessions ready at the same time share one forward. A step takes at most the engine's
max_batch_tokens rows and max_batch_sessions sessions, the longest-waiting first; the rest wait for the next
step, so an overload raises latency instead of failing steps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from modeling.tree import DraftTree
from verifier_service.engine.engine import Engine, StepResult
from verifier_service.worker import EngineWorker


@dataclass
class _Pending:
    session_id: str
    tree: DraftTree
    future: asyncio.Future


class StepBatcher:
    def __init__(self, engine: Engine, worker: EngineWorker, generating: Callable[[], int]):
        """generating: how many sessions are generating (in a step, between steps, or queued here)."""
        self.engine, self.worker, self.generating = engine, worker, generating
        self.queue: list[_Pending] = []
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="step-batcher")

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def submit(self, session_id: str, tree: DraftTree) -> StepResult:
        pending = _Pending(session_id, tree, asyncio.get_running_loop().create_future())
        self.queue.append(pending)
        self.wakeup.set()
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            # NOTE: a cancelled caller must not leave a step for a session it is about to release:
            # either take it out of the queue or wait until the running step has finished with it.
            if pending in self.queue:
                self.queue.remove(pending)
            else:
                await asyncio.gather(pending.future, return_exceptions=True)
            raise

    async def _run(self) -> None:
        while True:
            if not self.queue:
                await self.wakeup.wait()
            self.wakeup.clear()
            if self.queue:
                await self._step(self._take())

    def _take(self) -> list[_Pending]:
        """The longest-waiting steps that fit one batch (one that fits nowhere goes alone: the engine refuses it)."""
        config, rows, taken = self.engine.config, 0, 0
        for pending in self.queue:
            size = len(pending.tree) + 1
            if taken and (rows + size > config.max_batch_tokens or taken == config.max_batch_sessions):
                break
            rows, taken = rows + size, taken + 1
        batch, self.queue = self.queue[:taken], self.queue[taken:]
        return batch

    async def _step(self, batch: list[_Pending]) -> None:
        try:
            # NOTE: a session between steps needs the loop during this one (its draft round trip overlaps the
            # GPU work), so only a batch of every generating session may run on the loop itself.
            call = self.worker.step_call if len(batch) >= self.generating() else self.worker.call
            results = await call(self.engine.step, [(p.session_id, p.tree) for p in batch])
        except Exception as error:  # noqa: BLE001 - handed to the waiting caller
            if len(batch) == 1:
                batch[0].future.set_exception(error)
                return
            # NOTE: the engine validates and reserves pages before it runs anything, so a failed batch
            # changed nothing; stepping the sessions one by one isolates the one at fault.
            for pending in batch:
                await self._step([pending])
            return
        for pending, result in zip(batch, results):
            pending.future.set_result(result)
