"""The DFlash drafter's session mirror: per-session context K/V in fixed slots, drafts batched over sessions.

Each open session owns a slot of per-layer buffers [max_sessions, C + B, Hkv, D] holding the K/V of its most
recent committed positions (they depend only on the target features, so they are computed once, when the
tokens are committed). Position p lives in row p % C of its slot, a ring, so appends never move rows, and a
per-slot position array says what each row holds (-1 = empty); a draft batch just names slots. A layer
keeps what its queries can see (the sliding window, the serving window W) plus one block of slack, so a
rollback of up to one block (crop) drafts exactly as a mirror that never went past it. A layer with no
bound (no W, not sliding) grows its buffers, and moves them, as sessions grow: drafts then run eagerly.

When every layer is bounded, a step's committed rows are stored by `write_rows`, whose shapes come from the row
count alone (no host reads, no data-dependent indexing), so DraftGraphs can replay it from a CUDA graph; bounded
layers then keep one extra slot, `dump_slot`, where the padding rows of such a graph go.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from drafter_service.errors import SessionNotFound, StaleStep, TooManySessions
from modeling.dflash import DFlashModel, KeyValue, LayerContext
from modeling.speculation import DraftStep


class DraftBatch(NamedTuple):
    """The model's view of a batch of DraftSteps: S ints per field, on the host (DFlashModel.draft_logits)."""

    slots: list[int]
    roots: list[int]
    starts: list[int]  # committed length n: the block sits at positions n..n+B-1


class RowBatch(NamedTuple):
    """A commit's rows for `write_rows`: row i (features[i]) holds position positions[i] of slot slots[i]; no two
    rows share a slot's ring row in any layer."""

    features: torch.Tensor  # [N, F] in the model's dtype, on the host or the model's device
    slots: list[int]
    positions: list[int]


RowWriter = Callable[[RowBatch], None]


@dataclass
class _Mirror:
    slot: int
    length: int  # committed positions n; the next block starts at position n
    first: int  # the oldest position an unbounded layer holds (its ring must span first..n-1)
    last_step: int | None = None


class _Rows(NamedTuple):
    """Newly committed tokens' K/V for every layer, computed but not yet stored."""

    kv: list[KeyValue]  # per layer (K, V) [N, Hkv, D]
    positions: torch.Tensor  # [N] int64, host
    owners: torch.Tensor  # [N] int64, host: the index of each row's mirror
    counts: list[int]  # positions each mirror gains


class DFlashMirrors:
    """The mirrors of one replica's sessions over one loaded DFlash model (not thread-safe)."""

    def __init__(self, model: DFlashModel, context_window: int | None = None, max_sessions: int = 64):
        """context_window: W, the most recent committed positions every layer attends to (None = all);
        max_sessions: slots, i.e. sessions open at once (bounded layers allocate them all up front)."""
        config = model.config
        if context_window is not None and context_window < config.block_size:
            raise ValueError(f"context window {context_window} is smaller than the block size {config.block_size}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.model, self.context_window, self.max_sessions = model, context_window, max_sessions
        visible = [config.visible_context(i, context_window) for i in range(config.model.num_layers)]
        self._retained = [None if v is None else v + config.block_size for v in visible]
        self.dump_slot = max_sessions  # NOTE: bounded layers hold it; no session ever drafts from it
        self.contexts = [self._allocate(max_sessions + 1, r) if r is not None else self._allocate(0, config.block_size)
                         for r in self._retained]
        self._free = list(range(max_sessions))  # a heap: the lowest free slot goes first
        self._sessions: dict[str, _Mirror] = {}

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    @property
    def bounded(self) -> bool:
        """Every layer's buffers keep their size and address for good (what a CUDA graph of the draft needs)."""
        return None not in self._retained

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def context_length(self, session_id: str) -> int:
        """Committed positions the session's mirror covers (the next block starts there)."""
        return self._mirror(session_id).length

    @torch.inference_mode()
    def open(self, session_id: str, features: torch.Tensor, start_position: int) -> None:
        """Seed (or replace) a mirror: features [n, F] of committed tokens at start_position.. (only the
        last ones the layers can see are used). Raises TooManySessions when every slot is taken."""
        old = self._sessions.get(session_id)
        if old is None and not self._free:
            raise TooManySessions(f"{self.max_sessions} sessions are open on this drafter (its max_sessions); "
                                  "close one first")
        mirror = _Mirror(-1, start_position, start_position)
        rows = self._project([mirror], [features])  # NOTE: may raise; nothing has changed yet
        mirror.slot = old.slot if old is not None else heapq.heappop(self._free)
        for context in self.contexts:
            if mirror.slot < context.positions.shape[0]:
                context.positions[mirror.slot] = -1
        self._write([mirror], rows)
        self._sessions[session_id] = mirror

    @torch.inference_mode()
    def crop(self, session_id: str, num_positions: int) -> None:
        """Roll the mirror back to `num_positions` committed positions (e.g. tokens past a stop)."""
        mirror = self._mirror(session_id)
        if num_positions > mirror.length:
            raise ValueError(f"cannot crop session {session_id!r} of {mirror.length} positions to {num_positions}")
        for context in self.contexts:
            held = context.positions[mirror.slot]
            held.masked_fill_(held >= num_positions, -1)
        mirror.length, mirror.first = num_positions, min(mirror.first, num_positions)

    def close(self, session_id: str) -> None:
        mirror = self._sessions.pop(session_id, None)
        if mirror is not None:
            heapq.heappush(self._free, mirror.slot)

    @torch.inference_mode()
    def commit(self, steps: Sequence[DraftStep], writer: RowWriter | None = None) -> DraftBatch:
        """Add each step's committed features (in the model's dtype) to its mirror -> the batch's draft inputs.
        Nothing changes if any step is invalid (unknown or repeated session, stale step). `writer` stores the
        rows when every layer is bounded and no step brings more rows than the smallest layer keeps (default
        `write_rows` right now); other commits are stored eagerly here."""
        mirrors = [self._mirror(s.session_id) for s in steps]
        if len({s.session_id for s in steps}) != len(steps):
            raise ValueError("a session may appear once per draft batch")
        for step, mirror in zip(steps, mirrors):
            if mirror.last_step is not None and step.step <= mirror.last_step:
                raise StaleStep(f"session {step.session_id!r}: step {step.step} <= {mirror.last_step}")
        features = [s.features for s in steps]
        if steps and self.bounded and max(f.shape[0] for f in features) <= min(self._retained):
            counts = [f.shape[0] for f in features]
            slots = [m.slot for m, count in zip(mirrors, counts) for _ in range(count)]
            positions = [p for m, count in zip(mirrors, counts) for p in range(m.length, m.length + count)]
            if slots:
                rows = features[0] if len(features) == 1 else torch.cat(features)
                (writer or self.write_now)(RowBatch(rows, slots, positions))
            for mirror, count in zip(mirrors, counts):
                mirror.length += count
        elif steps:
            self._write(mirrors, self._project(mirrors, features))
        for step, mirror in zip(steps, mirrors):
            mirror.last_step = step.step
        return DraftBatch([m.slot for m in mirrors], [s.root for s in steps], [m.length for m in mirrors])

    def write_now(self, rows: RowBatch) -> None:
        """The default RowWriter: the rows' tensors on the device, then write_rows."""
        device = self.model.fc.weight.device
        self.write_rows(rows.features.to(device), *torch.tensor([rows.slots, rows.positions], device=device))

    @torch.inference_mode()
    def write_rows(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Store rows of committed features in every layer of bounded mirrors: the K/V of features[i] [N, F] at
        row positions[i] % C of slot slots[i] ([N] int64), all on the model's device. Shapes depend on N alone,
        so a CUDA graph can hold this; rows aimed at dump_slot are padding."""
        self.model.store_context(self.model.context_features(features), positions, slots, self.contexts)

    @torch.inference_mode()
    def draft_batch(self, steps: Sequence[DraftStep]) -> torch.Tensor:
        """commit, then the full per-depth distributions of all sessions in one eager forward -> log-probs
        [S, B-1, V] (fp32). Serving drafts only the top-k (DraftGraphs); this is the whole picture."""
        inputs = self.commit(steps)
        head = self.model.lm_head.weight
        if not inputs.slots:
            return torch.empty(0, self.block_size - 1, head.shape[0], device=head.device)
        slots, roots, starts = torch.tensor(inputs, device=head.device)
        logits = self.model.draft_logits(roots, starts, slots, self.contexts, self.context_window)
        return torch.log_softmax(logits.float(), dim=-1)

    def _mirror(self, session_id: str) -> _Mirror:
        if session_id not in self._sessions:
            raise SessionNotFound(f"session {session_id!r} is not open on this drafter")
        return self._sessions[session_id]

    def _allocate(self, rows: int, capacity: int) -> LayerContext:
        config, weight = self.model.config.model, self.model.fc.weight
        shape = (rows, capacity + self.block_size, config.num_kv_heads, config.head_dim)
        return LayerContext(weight.new_zeros(shape), weight.new_zeros(shape),
                            torch.full((rows, capacity), -1, dtype=torch.long, device=weight.device))

    def _project(self, mirrors: list[_Mirror], features: list[torch.Tensor]) -> _Rows:
        """K/V of newly committed tokens (one projection for all sessions), only of those a layer may keep."""
        most = None if None in self._retained else max(self._retained)
        kept = [f if most is None else f[max(0, f.shape[0] - most):] for f in features]
        ends = [m.length + f.shape[0] for m, f in zip(mirrors, features)]
        positions = torch.cat([torch.arange(end - k.shape[0], end) for end, k in zip(ends, kept)])
        owners = torch.repeat_interleave(torch.arange(len(kept)), torch.tensor([k.shape[0] for k in kept]))
        return _Rows(self._kv_rows(torch.cat(kept), positions), positions, owners, [f.shape[0] for f in features])

    def _kv_rows(self, features: torch.Tensor, positions: torch.Tensor) -> list[KeyValue]:
        # features: [N, F]; positions: [N] -> per layer (K, V) [N, Hkv, D]
        device = self.model.fc.weight.device
        return self.model.context_key_values(self.model.context_features(features.to(device)), positions.to(device))

    def _write(self, mirrors: list[_Mirror], rows: _Rows) -> None:
        """Store projected rows in the mirrors' slots: each layer keeps each session's last C positions."""
        ends = [m.length + count for m, count in zip(mirrors, rows.counts)]
        self._reserve(mirrors, ends)
        slots = torch.tensor([m.slot for m in mirrors])[rows.owners]  # [N]
        limits = torch.tensor(ends)[rows.owners]  # [N]: each row's session end
        device = self.model.fc.weight.device
        scatter: dict[int, tuple[torch.Tensor, ...]] = {}  # capacity -> (kept rows, slot, ring row, position)
        for (keys, values), context in zip(rows.kv, self.contexts):
            capacity = context.capacity
            if capacity not in scatter:
                kept = (rows.positions >= limits - capacity).nonzero().squeeze(1)
                position = rows.positions[kept]
                scatter[capacity] = tuple(t.to(device) for t in (kept, slots[kept], position % capacity, position))
            kept, slot, ring, position = scatter[capacity]
            context.store(slot, ring, position, keys[kept], values[kept])
        for mirror, end in zip(mirrors, ends):
            mirror.length = end

    def _reserve(self, mirrors: list[_Mirror], ends: list[int]) -> None:
        """Grow the unbounded layers to hold these slots and spans of positions (bounded ones never move)."""
        rows = max(m.slot for m in mirrors) + 1
        span = max(end - m.first for m, end in zip(mirrors, ends))
        for layer, context in enumerate(self.contexts):
            have = context.positions.shape[0]
            if self._retained[layer] is None and (rows > have or span > context.capacity):
                grown = self._allocate(min(max(rows, 2 * have), self.max_sessions), max(span, 2 * context.capacity))
                self.contexts[layer] = _relayout(context, grown)


def _relayout(old: LayerContext, new: LayerContext) -> LayerContext:
    """Move every held row of `old` into the ring of the larger `new` (position p to row p % capacity)."""
    slot, row = (old.positions >= 0).nonzero(as_tuple=True)
    position = old.positions[slot, row]
    ring = position % new.capacity
    new.store(slot, ring, position, old.keys[slot, row], old.values[slot, row])
    return new
