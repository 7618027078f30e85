"""All engine calls go through one thread: the engine is not thread-safe, and long work (a prefill) must not
block the event loop that serves gRPC. A verify step may run on the loop itself while that thread is idle."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Callable
from typing import TypeVar

from modeling.ops import use_device

T = TypeVar("T")


class EngineWorker:
    def __init__(self, inline_steps: bool = True, device: str = "cpu"):
        """inline_steps: let `step_call` run on the calling loop when the engine thread is idle. Off with
        tensor-parallel peers: a collective stuck on a dead rank must not freeze the loop that marks the
        engine down. device: the engine's, made the thread's current device (modeling.ops.use_device)."""
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine",
                                                              initializer=functools.partial(use_device, device))
        self.inline_steps = inline_steps
        self.last: concurrent.futures.Future | None = None  # NOTE: one thread, FIFO: when it is done, all are
        self.busy_seconds = 0.0  # the engine's time on the calls ended so far, of every kind

    async def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> asyncio.Future[T]:
        """`call`, queued on the engine thread now, awaited later (the caller goes on meanwhile)."""
        self.last = self.executor.submit(self._run, fn, *args, **kwargs)
        return asyncio.wrap_future(self.last)

    async def step_call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`call` for a verify step that nothing else on the loop waits on (the caller knows): when no engine
        work is queued or running, run it right here: the hop to the thread and back would sit inside every
        step, and nothing else can use the engine meanwhile."""
        if self.inline_steps and (self.last is None or self.last.done()):
            return self._run(fn, *args, **kwargs)
        return await self.call(fn, *args, **kwargs)

    def _run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn on the engine, its time counted in `busy_seconds` (a step's caller tells the engine work of others,
        a prefill chunk say, from its own and from the host's in the time between two of its steps)."""
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy_seconds += time.perf_counter() - started

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
