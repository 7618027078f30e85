"""The draft forward plus its per-depth top-k, replayed from CUDA graphs, one graph per batch-size bucket.

Run eagerly, the drafter launches a long chain of small kernels per draft and its log_softmax writes
S * (B-1) * V floats (V = 152k for Qwen3) for the top-k to read K of them. A replay is one launch; inside
it the top-k turns only the K kept logits into log-probs, and only the [S, B-1, K] results travel to the
host, where the DDTree heap runs. Every shape in a graph comes from its bucket: the mirror's slot buffers
never move (a bounded context window), a batch names its sessions by slot, and a batch smaller than its
bucket is padded with repeats of its first session, whose outputs are dropped. On the CPU, with graphs
off, or with an unbounded layer (no W), the same function runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from drafter_service.dflash_mirrors import DFlashMirrors, DraftBatch
from drafter_service.tree_builder import top_k_log_probs
from modeling.graph_capture import buckets, capture


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    values: torch.Tensor  # [bucket, B-1, K] fp32, rewritten by every replay
    ids: torch.Tensor  # [bucket, B-1, K] int64


class DraftGraphs:
    """Drafts a batch of committed mirrors down to ranked per-depth top-k lists on the host."""

    def __init__(self, mirrors: DFlashMirrors, top_k: int, cuda_graphs: bool = True):
        """top_k: K, the ranks kept per depth (the largest tree budget served)."""
        self.mirrors, self.top_k = mirrors, top_k
        self.device = device = mirrors.model.fc.weight.device
        # NOTE: a graph reads the slot buffers at their capture-time addresses; only bounded ones keep them.
        self.graphed = cuda_graphs and device.type == "cuda" and mirrors.bounded
        self.buckets = buckets(mirrors.max_sessions)
        self.captured: dict[int, _Captured] = {}
        if self.graphed:
            self.host = torch.zeros(3, mirrors.max_sessions, dtype=torch.long, pin_memory=True)
            self.inputs = torch.zeros(3, mirrors.max_sessions, dtype=torch.long, device=device)  # slots, roots, starts
            self.pool = torch.cuda.graph_pool_handle()  # NOTE: buckets never replay at once, so they share memory

    @torch.inference_mode()
    def run(self, inputs: DraftBatch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the `width` best log-probs (fp32) and token ids per depth, ranked best first with ties by token
        id (ddtree's contract), [S, B-1, width] on the host."""
        count = len(inputs.slots)
        if self.graphed:
            size = next(b for b in self.buckets if b >= count)
            with torch.cuda.device(self.device):  # NOTE: the calling thread's current device may be another
                self._upload(inputs, size)
                captured = self.captured.get(size) or self._capture(size)
                captured.graph.replay()
            values, ids = captured.values, captured.ids
        else:
            values, ids = self._forward(*torch.tensor(inputs, device=self.device))
        return _to_host(values[:count, :, :width], ids[:count, :, :width])

    @torch.inference_mode()
    def warmup(self, progress: Callable[[list], Iterable] = iter) -> None:
        """Capture every bucket now, not on its first batch (nothing to do when drafts run eagerly); `progress`
        wraps the list of buckets (ddtree.progress.track)."""
        for size in progress(self.buckets) if self.graphed else []:
            if size not in self.captured:
                with torch.cuda.device(self.device):
                    self._capture(size)

    def _forward(self, slots: torch.Tensor, roots: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # slots, roots, starts: [S] -> ranked top-k log-probs and ids [S, B-1, K]
        mirrors = self.mirrors
        logits = mirrors.model.draft_logits(roots, starts, slots, mirrors.contexts, mirrors.context_window)
        return top_k_log_probs(logits, self.top_k)

    def _upload(self, inputs: DraftBatch, size: int) -> None:
        count = len(inputs.slots)
        # NOTE: the previous run waited for its results, so its upload has left the pinned buffer.
        self.host[:, :count] = torch.tensor(inputs)
        self.host[:, count:size] = self.host[:, :1]  # padding: the first session again, its rows dropped
        self.inputs.copy_(self.host, non_blocking=True)

    def _capture(self, size: int) -> _Captured:
        slots, roots, starts = self.inputs[:, :size]
        graph, (values, ids) = capture(lambda: self._forward(slots, roots, starts), self.device, self.pool)
        self.captured[size] = _Captured(graph, values, ids)
        return self.captured[size]


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of the tensors, with one wait for all of them when they are on a GPU."""
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    if tensors[0].is_cuda:
        torch.cuda.current_stream(tensors[0].device).synchronize()
    return copies
