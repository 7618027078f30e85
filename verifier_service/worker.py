"""All engine calls go through one thread: the engine is not thread-safe, and its (GPU) work must not
block the event loop that serves gRPC."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class EngineWorker:
    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
