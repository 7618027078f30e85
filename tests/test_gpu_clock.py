"""The GPU clock around engine calls: event pairs read in call order, each once its end has passed."""

from __future__ import annotations

import pytest
import torch

from verifier_service.gpu_clock import GpuClock


class FakeGpu:
    """A GPU timeline the test moves by hand: an event records 'now' and has passed once the GPU reaches it."""

    def __init__(self) -> None:
        self.now, self.reached = 0.0, 0.0

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGpu):
        self.gpu, self.at = gpu, None

    def record(self) -> None:
        self.at = self.gpu.now

    def query(self) -> bool:
        return self.gpu.reached >= self.at

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3  # NOTE: milliseconds, as CUDA events report


def test_calls_are_read_in_order_once_their_end_has_passed_on_the_gpu() -> None:
    gpu = FakeGpu()
    clock = GpuClock(gpu.event)
    for seconds in (0.004, 0.002):
        mark = clock.start()
        gpu.now += seconds
        clock.stop(mark)
    assert clock.finished() == []  # NOTE: the GPU has not reached the first call's end yet
    gpu.reached = 0.005
    assert clock.finished() == pytest.approx([0.004])
    gpu.reached = 1.0
    assert clock.finished() == pytest.approx([0.002]) and clock.finished() == []


def test_without_a_gpu_the_clock_measures_nothing() -> None:
    clock = GpuClock.for_device("cpu")
    clock.stop(clock.start())
    assert not clock.enabled and clock.finished() == []


@pytest.mark.gpu
def test_a_cuda_clock_measures_the_gpu_work_between_its_events() -> None:
    clock = GpuClock.for_device("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    mark = clock.start()
    for _ in range(10):
        a = a @ a / 4096
    clock.stop(mark)
    torch.cuda.synchronize()
    (seconds,) = clock.finished()
    assert 0 < seconds < 1
