"""The engine's forward captured as CUDA graphs, one per (sessions, tokens) bucket, replayed every step.

An eager forward launches every op of every layer from the host, and those launches cost more than the GPU
work of a decode step (benchmarks/results/e2e_step.md: 'eager verify' against 'verify'). A replay costs one
launch. Every launch shape inside the graph comes from the bucket alone: the attention kernels split each
sequence's prefix on the device (any length up to `max_context`), and positions and ancestor masks are built
on the device from parent rows.
The host writes tokens, parent rows, prefix lengths, block starts and block tables into one pinned buffer
and uploads it with one copy; nothing in the step waits for the GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ddtree_kernels.tree_mask import tree_positions_and_mask
from modeling.graph_capture import buckets, capture
from verifier_service.engine.verify_batch import BlockSpec, VerifyBatch

Forward = Callable[[VerifyBatch], tuple[torch.Tensor, torch.Tensor | None]]
MIN_TOKENS = 16  # smallest token bucket: below it a step costs the same (the weights dominate)


@dataclass(frozen=True)
class Buckets:
    """The (sessions, tokens, rows) shapes with a graph: powers of two, tokens from MIN_TOKENS. `rows` bounds the
    largest block: the attention kernels size their query tiles and merge grid by it, so a step of one-row blocks
    (plain decoding) must not run in a graph sized for trees of hundreds of rows."""

    seqs: tuple[int, ...]
    tokens: tuple[int, ...]
    rows: tuple[int, ...]

    @staticmethod
    def up_to(max_seqs: int, max_tokens: int, max_rows: int) -> Buckets:
        return Buckets(tuple(buckets(max_seqs)), tuple(buckets(max_tokens, MIN_TOKENS)), tuple(buckets(max_rows)))

    def fit(self, block_sizes: list[int]) -> tuple[int, int, int] | None:
        """The smallest bucket that holds blocks of these row counts, None when none does."""
        num_tokens, largest = sum(block_sizes), max(block_sizes)
        if len(block_sizes) > self.seqs[-1] or num_tokens > self.tokens[-1] or largest > self.rows[-1]:
            return None
        seqs = next(s for s in self.seqs if s >= len(block_sizes))
        tokens = next(t for t in self.tokens if t >= max(num_tokens, seqs))
        return seqs, tokens, next(r for r in self.rows if r >= largest)

    def reachable(self, tokens_per_session: int, prefill_chunk: int) -> dict[tuple[int, int, int], list[int]]:
        """Every bucket that a prefill chunk (one session, up to `prefill_chunk` rows) or a step of sessions
        with up to `tokens_per_session` rows each can land in, with the block sizes of one batch that does."""
        found = {}
        for (fewest, seqs), tokens, (smallest, rows) in itertools.product(
                zip((0, *self.seqs), self.seqs), self.tokens, zip((0, *self.rows), self.rows)):
            per_session = max(tokens_per_session, prefill_chunk) if seqs == 1 else tokens_per_session
            # NOTE: a batch of fewer blocks than the bucket is padded; its largest block is any in (smallest, rows]
            batches = ((count, largest) for count in range(fewest + 1, seqs + 1)
                       for largest in {smallest + 1, min(rows, per_session)} if smallest < largest <= per_session)
            for count, largest in batches:
                sizes = spread(min(tokens, count * largest), count, largest)
                if sizes is not None and self.fit(sizes) == (seqs, tokens, rows):
                    found[seqs, tokens, rows] = sizes
                    break
        return found


def spread(total: int, count: int, largest: int) -> list[int] | None:
    """`count` block sizes summing to `total`, the first `largest` and the rest 1..largest; None if none can."""
    rest = total - largest
    if count == 1:
        return [largest] if rest == 0 else None
    if not count - 1 <= rest <= (count - 1) * largest:
        return None
    return [largest] + [rest // (count - 1) + (i < rest % (count - 1)) for i in range(count - 1)]


@dataclass(frozen=True)
class Layout:
    """Where each input lives in the one int32 upload buffer (offsets in elements)."""

    max_seqs: int
    max_tokens: int
    max_pages: int

    @property
    def ids(self) -> slice:
        return slice(0, self.max_tokens)

    @property
    def parents(self) -> slice:
        return slice(self.max_tokens, 2 * self.max_tokens)

    @property
    def prefix_lens(self) -> slice:
        start = 2 * self.max_tokens
        return slice(start, start + self.max_seqs)

    @property
    def cu_tree(self) -> slice:
        start = 2 * self.max_tokens + self.max_seqs
        return slice(start, start + self.max_seqs + 1)

    @property
    def tables(self) -> slice:
        start = 2 * self.max_tokens + 2 * self.max_seqs + 1
        return slice(start, start + self.max_seqs * self.max_pages)

    @property
    def size(self) -> int:
        return self.tables.stop


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [tokens, H], rewritten by every replay
    features: torch.Tensor | None


class GraphedForward:
    """Replays captured forwards for batches that fit a bucket; captures a bucket on its first use."""

    def __init__(self, forward: Forward, layout: Layout, max_block_tokens: int, max_context: int,
                 device: torch.device):
        """max_block_tokens: the most rows of one block (a tree with its root, or a prefill chunk)."""
        self.forward, self.layout, self.device = forward, layout, device
        self.max_block_tokens, self.max_context = max_block_tokens, max_context
        self.buckets = Buckets.up_to(layout.max_seqs, layout.max_tokens, max_block_tokens)
        self.host = torch.zeros(layout.size, dtype=torch.int32, pin_memory=True)
        self.host_array = self.host.numpy()  # NOTE: the same memory; numpy writes keep the GIL (see _upload)
        self.inputs = torch.zeros(layout.size, dtype=torch.int32, device=device)
        self.positions = torch.zeros(layout.max_tokens, dtype=torch.int64, device=device)
        self.tree_mask = torch.zeros(layout.max_tokens, -(-max_block_tokens // 32), dtype=torch.int32, device=device)
        self.uploaded = torch.cuda.Event()
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Captured] = {}

    def bucket(self, blocks: list[BlockSpec]) -> tuple[int, int, int] | None:
        """(sessions, tokens, rows) of the smallest bucket the blocks fit, None when none does."""
        if max(len(b.pages) for b in blocks) > self.layout.max_pages:
            return None
        return self.buckets.fit([len(b.tokens) for b in blocks])

    def run(self, blocks: list[BlockSpec], capture_key: tuple, input_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """hidden [N, H] and features for the blocks' N rows (copies: the next replay reuses the outputs), or
        None when the blocks fit no bucket. `capture_key` names whatever else the captured forward depends on
        (the captured feature layers). `input_ids`: the rows' tokens on the device, in place of the blocks'."""
        bucket = self.bucket(blocks)
        if bucket is None:
            return None
        seqs, tokens, _ = bucket
        self._upload(blocks, seqs, tokens)
        if input_ids is not None:
            self.inputs[: len(input_ids)].copy_(input_ids)  # NOTE: the ids lead the buffer (Layout.ids)
        key = (*bucket, capture_key)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*bucket)
        captured = self.graphs[key]
        captured.graph.replay()
        rows = sum(len(b.tokens) for b in blocks)
        features = None if captured.features is None else captured.features[:rows].clone()
        return captured.hidden[:rows].clone(), features

    def _upload(self, blocks: list[BlockSpec], seqs: int, tokens: int) -> None:
        """Write the batch into the pinned buffer with numpy and upload it with one copy. NOTE: every torch call
        lets go of the GIL and must take it back; beside a busy event loop each one can wait a thread switch
        interval, so the host side of a step uses as few torch calls as it can, none per session."""
        layout, host = self.layout, self.host_array
        self.uploaded.synchronize()  # NOTE: the previous upload has left the pinned buffer
        ids, parents, cu = [], [], [0]
        for block in blocks:
            ids += block.tokens
            parents += [p + cu[-1] if p >= 0 else -1 for p in block.parent_rows]
            cu.append(cu[-1] + len(block.tokens))
        padding = tokens - cu[-1]
        fill(host, layout.ids, ids + [0] * padding)
        fill(host, layout.parents, parents + [-1] * padding)
        fill(host, layout.prefix_lens, [b.prefix_len for b in blocks] + [0] * (seqs - len(blocks)))
        fill(host, layout.cu_tree, cu + [cu[-1]] * (seqs - len(blocks)))
        for row, block in enumerate(blocks):
            start = layout.tables.start + row * layout.max_pages
            fill(host, slice(start, start + len(block.pages)), block.pages)
        used = layout.tables.start + seqs * layout.max_pages
        self.inputs[:used].copy_(self.host[:used], non_blocking=True)
        self.uploaded.record()

    def _batch(self, seqs: int, tokens: int, rows: int) -> VerifyBatch:
        """The static batch of one bucket: views of the upload buffer and of the device-built rows."""
        layout, inputs = self.layout, self.inputs
        tables = inputs[layout.tables].view(layout.max_seqs, layout.max_pages)[:seqs]
        return VerifyBatch(
            input_ids=inputs[layout.ids][:tokens],
            positions=self.positions[:tokens],
            block_tables=tables,
            prefix_lens=inputs[layout.prefix_lens][:seqs],
            cu_tree=inputs[layout.cu_tree][: seqs + 1],
            tree_mask=self.tree_mask[:tokens],
            max_prefix_len=self.max_context,
            max_tree_len=min(tokens, rows),
        )

    @torch.inference_mode()
    def _capture(self, seqs: int, tokens: int, rows: int) -> _Captured:
        batch = self._batch(seqs, tokens, rows)
        parents = self.inputs[self.layout.parents][:tokens]

        def step() -> tuple[torch.Tensor, torch.Tensor | None]:
            tree_positions_and_mask(parents, batch.cu_tree, batch.prefix_lens, batch.positions, batch.tree_mask)
            return self.forward(batch)

        graph, (hidden, features) = capture(step, self.device, self.pool)
        return _Captured(graph, hidden, features)


def fill(host: np.ndarray, where: slice, values: list[int]) -> None:
    host[where.start: where.start + len(values)] = values
