"""The GPU's time on each engine call, from a CUDA event pair around it: against the step's wall time, what the
host costs a step (issue 26's host overhead: step wall time less GPU busy time).

A pair is read one call late, once its end has passed on the GPU: a call returns while its last kernels (the KV
commit) may still run, and waiting for them would take the next step's host work off the GPU's shadow."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Protocol


class TimingEvent(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end: TimingEvent) -> float: ...


class GpuClock:
    """Event pairs around engine calls, in call order. `new_event`: a timing CUDA event's constructor, or None
    where there is no GPU (the clock then measures nothing)."""

    def __init__(self, new_event: Callable[[], TimingEvent] | None):
        self.new_event = new_event
        self.pending: collections.deque[tuple[TimingEvent, TimingEvent]] = collections.deque()

    @staticmethod
    def for_device(device: str) -> GpuClock:
        """A clock for the engine's device ("cuda", "cuda:1", "cpu", ...)."""
        if not device.startswith("cuda"):
            return GpuClock(None)
        import torch

        return GpuClock(lambda: torch.cuda.Event(enable_timing=True))

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

    def finished(self) -> list[float]:
        """The GPU seconds of the calls whose work has ended since the last look, oldest first."""
        done = []
        while self.pending and self.pending[0][1].query():
            start, end = self.pending.popleft()
            done.append(start.elapsed_time(end) / 1e3)
        return done
