"""A draft step replayed from CUDA graphs: the commit of the step's rows (one graph per row-count bucket) and the
draft forward down to its logits (one graph per batch-size bucket), then the per-depth top-k.

Run eagerly, the drafter launches a long chain of small kernels per draft: ~200 for the commit alone (the
features' projection, each layer's K/V, their scatter into the mirrors). A replay is one launch. The top-k runs
after it, on the batch's rows only and as wide as the batch's largest budget (three launches, queued while the
replay runs; a graph would fix K at the largest budget served, 255 by default), and turns only the K kept logits
into log-probs; the DDTree heap follows on the GPU (`tree_builder.draft_trees`): only the trees' nodes travel to
the host. Every shape in a graph comes from its bucket: the mirror's slot buffers never move (a bounded context
window), a batch names its sessions by slot, a batch smaller than its bucket is padded with repeats of its first
session, whose outputs are dropped, and a commit's padding rows go to the mirrors' dump slot. The rows' features
reach the device in one copy from pinned memory. On the CPU, with graphs off, or with an unbounded layer (no W),
the same functions run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np
import torch

from drafter_service.dflash_mirrors import DFlashMirrors, DraftBatch, RowBatch
from drafter_service.tree_builder import top_k_log_probs
from modeling.graph_capture import buckets, capture


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, B-1, V], rewritten by every replay


class _Rows(NamedTuple):
    """The commit graphs' inputs: features [R, F] and (slots, positions) [2, R], on the device, with their
    pinned host copies."""

    features: torch.Tensor
    indices: torch.Tensor
    host_features: torch.Tensor
    host_indices: torch.Tensor
    host_index_array: np.ndarray  # NOTE: host_indices' memory: numpy writes cost a few us where torch's cost tens


class DraftGraphs:
    """Commits a draft step's rows and drafts a batch of committed mirrors down to ranked per-depth top-k
    lists."""

    def __init__(self, mirrors: DFlashMirrors, cuda_graphs: bool = True):
        self.mirrors = mirrors
        self.device = device = mirrors.model.fc.weight.device
        # NOTE: a graph reads the slot buffers at their capture-time addresses; only bounded ones keep them.
        self.graphed = cuda_graphs and device.type == "cuda" and mirrors.bounded
        self.buckets = buckets(mirrors.max_sessions)
        self.row_buckets = buckets(mirrors.max_sessions * mirrors.block_size, mirrors.block_size)
        self.captured: dict[int, _Captured] = {}
        self.committers: dict[int, torch.cuda.CUDAGraph] = {}
        if self.graphed:
            self.host = torch.zeros(3, mirrors.max_sessions, dtype=torch.long, pin_memory=True)
            self.host_array = self.host.numpy()  # NOTE: the same memory, written with numpy (see _Rows)
            self.inputs = torch.zeros(3, mirrors.max_sessions, dtype=torch.long, device=device)  # slots, roots, starts
            self.rows = _row_buffers(mirrors, self.row_buckets[-1])
            self.pool = torch.cuda.graph_pool_handle()  # NOTE: buckets never replay at once, so they share memory

    @torch.inference_mode()
    def draft(self, inputs: DraftBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the k best log-probs (fp32) and token ids per depth, ranked best first with ties by token id
        (ddtree's contract), [S, B-1, k] on the drafter's device."""
        count = len(inputs.slots)
        if not self.graphed:
            return top_k_log_probs(self._forward(*torch.tensor(inputs, device=self.device)), k)
        size = next(b for b in self.buckets if b >= count)
        with torch.cuda.device(self.device):  # NOTE: the calling thread's current device may be another
            self._upload(inputs, size)
            captured = self.captured.get(size) or self._capture(size)
            captured.graph.replay()
            return top_k_log_probs(captured.logits[:count], k)

    @torch.inference_mode()
    def write(self, rows: RowBatch) -> None:
        """The mirrors' RowWriter: the rows stored by commit graphs, the largest bucket's worth at a time."""
        if not self.graphed:
            self.mirrors.write_now(rows)
            return
        largest = self.row_buckets[-1]
        with torch.cuda.device(self.device):
            for start in range(0, len(rows.slots), largest):
                self._write_chunk(RowBatch(rows.features[start:start + largest], rows.slots[start:start + largest],
                                           rows.positions[start:start + largest]))

    @torch.inference_mode()
    def warmup(self, progress: Callable[[list], Iterable] = iter) -> None:
        """Capture every bucket now, not on its first batch (nothing to do when drafts run eagerly); `progress`
        wraps the list of graphs (ddtree.progress.track). A commit graph's capture writes its padding rows, which
        point at the dump slot until a commit has run."""
        graphs = [(self._capture, size) for size in self.buckets if size not in self.captured]
        graphs += [(self._capture_commit, size) for size in self.row_buckets if size not in self.committers]
        for capture_one, size in progress(graphs) if self.graphed else []:
            with torch.cuda.device(self.device):
                capture_one(size)

    def _forward(self, slots: torch.Tensor, roots: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        # slots, roots, starts: [S] -> logits [S, B-1, V]
        mirrors = self.mirrors
        return mirrors.model.draft_logits(roots, starts, slots, mirrors.contexts, mirrors.context_window)

    def _upload(self, inputs: DraftBatch, size: int) -> None:
        count = len(inputs.slots)
        # NOTE: the previous run waited for its results, so its upload has left the pinned buffer.
        host = self.host_array
        host[:, :count] = inputs
        host[:, count:size] = host[:, :1]  # padding: the first session again, its rows dropped
        self.inputs.copy_(self.host, non_blocking=True)

    def _write_chunk(self, rows: RowBatch) -> None:
        count = len(rows.slots)
        size = next(b for b in self.row_buckets if b >= count)
        buffers = self.rows
        # NOTE: the previous draft waited for its results, so the uploads before it have left the pinned buffers.
        host = buffers.host_index_array
        host[0, :count], host[1, :count] = rows.slots, rows.positions
        host[0, count:size] = self.mirrors.dump_slot
        buffers.indices[:, :size].copy_(buffers.host_indices[:, :size], non_blocking=True)
        if rows.features.is_cuda:
            buffers.features[:count].copy_(rows.features)
        else:
            buffers.host_features[:count].copy_(rows.features)
            buffers.features[:count].copy_(buffers.host_features[:count], non_blocking=True)
        (self.committers.get(size) or self._capture_commit(size)).replay()

    def _capture_commit(self, size: int) -> torch.cuda.CUDAGraph:
        """The commit of `size` rows, captured with every row aimed at the dump slot: the capture's first,
        uncaptured run writes nothing a session reads, whatever the buffers held."""
        features, (slots, positions) = self.rows.features[:size], self.rows.indices[:, :size]
        staged = slots.clone()
        slots.fill_(self.mirrors.dump_slot)
        self.committers[size], _ = capture(lambda: self.mirrors.write_rows(features, slots, positions), self.device,
                                           self.pool)
        slots.copy_(staged)
        return self.committers[size]

    def _capture(self, size: int) -> _Captured:
        slots, roots, starts = self.inputs[:, :size]
        graph, logits = capture(lambda: self._forward(slots, roots, starts), self.device, self.pool)
        self.captured[size] = _Captured(graph, logits)
        return self.captured[size]


def _row_buffers(mirrors: DFlashMirrors, rows: int) -> _Rows:
    """Buffers for `rows` committed rows."""
    weight = mirrors.model.fc.weight
    shape = (rows, mirrors.model.config.feature_dim)
    host_indices = torch.zeros(2, rows, dtype=torch.long, pin_memory=True)
    return _Rows(weight.new_zeros(shape), torch.zeros(2, rows, dtype=torch.long, device=weight.device),
                 torch.zeros(shape, dtype=weight.dtype, pin_memory=True), host_indices, host_indices.numpy())

