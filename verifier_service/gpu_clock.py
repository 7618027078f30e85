"""The GPU's time on each engine call, from a CUDA event pair around it: against the step's wall time, what the
host costs a step (issue 26's host overhead: step wall time less GPU busy time).

A pair is read at a later look, once its end has passed on the GPU: a call returns while its last kernels (the KV
commit) may still run, and waiting for them would take the next step's host work out of the GPU's shadow."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

T = TypeVar("T")


class TimingEvent(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end: TimingEvent) -> float: ...


class GpuClock:
    """Event pairs around engine calls, in call order. `new_event`: a timing event's constructor (a CudaEvent on
    the engine's device), or None where there is no GPU (the clock then measures nothing)."""

    def __init__(self, new_event: Callable[[], TimingEvent] | None):
        self.new_event = new_event
        self.pending: collections.deque[tuple[TimingEvent, TimingEvent]] = collections.deque()

    @staticmethod
    def for_device(device: str) -> GpuClock:
        """A clock for the engine's device ("cuda", "cuda:1", "cpu", ...)."""
        return GpuClock(lambda: CudaEvent(device)) if device.startswith("cuda") else GpuClock(None)

    @property
    def enabled(self) -> bool:
        return self.new_event is not None

    def start(self) -> TimingEvent | None:
        """On the thread that launches the call's work, before it."""
        if self.new_event is None:
            return None
        event = self.new_event()
        event.record()
        return event

    def stop(self, start: TimingEvent | None) -> None:
        """On the same thread, after the call's last launch."""
        if start is None:
            return
        end = self.new_event()
        end.record()
        self.pending.append((start, end))

    def timed(self, fn: Callable[..., T], *args) -> tuple[T, float]:
        """fn(*args) and the seconds it ran on the host (on the engine thread: not counting its wait behind queued
        work), its GPU work between a pair of this clock's events."""
        started = time.perf_counter()
        mark = self.start()
        result = fn(*args)
        self.stop(mark)
        return result, time.perf_counter() - started

    def finished(self) -> list[float]:
        """The GPU seconds of the calls whose work has ended since the last look, oldest first."""
        done = []
        while self.pending and self.pending[0][1].query():
            start, end = self.pending.popleft()
            done.append(start.elapsed_time(end) / 1e3)
        return done


class CudaEvent:
    """A timing CUDA event recorded on its device's current stream (the engine's device need not be the thread's
    current one)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def query(self) -> bool:
        return self.event.query()

    def elapsed_time(self, end: CudaEvent) -> float:
        return self.event.elapsed_time(end.event)
