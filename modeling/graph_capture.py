"""What the verifier's and the drafter's CUDA graphs share: bucket sizes and the capture routine."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def buckets(limit: int, smallest: int = 1) -> list[int]:
    """Sizes with a graph: powers of two from `smallest`, the last one clipped to `limit`."""
    sizes = [min(smallest, limit)]
    while sizes[-1] < limit:
        sizes.append(min(2 * sizes[-1], limit))
    return sizes


def capture(step: Callable[[], T], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `step` once on a side stream, then capture it into `pool`; returns the graph and the outputs that
    every replay rewrites. The first run is where Triton compiles and autotunes and cuBLAS picks its kernels:
    none of that may happen inside a capture."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        step()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # NOTE: thread-local: a service's event loop may copy tensors off the GPU during a capture.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = step()
    return graph, outputs
