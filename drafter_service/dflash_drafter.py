"""The DFlash drafter's session mirror: per-session context K/V, drafts batched over sessions.

Each open session keeps, per drafter layer, the K/V of its most recent committed positions (they depend
only on the target features, so they are computed once, when the tokens are committed). A draft attends
to them plus the block, whose K/V are dropped afterwards. A layer keeps what its queries can see (the
sliding window, the serving window W) plus one block of slack, so a rollback of up to one block (crop)
drafts exactly as a mirror that never went past it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

from modeling.dflash import DFlashModel, KeyValue, LayerContext


class SessionNotFound(KeyError):
    """The session is not open here (never opened, closed, or on another replica): re-seed it with open."""


class StaleStep(ValueError):
    """A step number not above the session's last one: the verifier no longer waits for it."""


class DraftRequest(NamedTuple):
    session_id: str
    features: torch.Tensor  # [m, F] target features of the tokens committed since the last draft
    bonus_token: int  # the pending root, not yet committed
    step_number: int | None = None  # when given, must increase per session


@dataclass
class _Mirror:
    length: int  # committed positions n; the next block starts at position n
    keys: list[torch.Tensor]  # per layer [L, Hkv, D]: K of positions n - L .. n - 1
    values: list[torch.Tensor]  # per layer [L, Hkv, D]
    last_step: int | None = None


class DFlashDrafter:
    """The mirrors of one replica's sessions over one loaded DFlash model (not thread-safe)."""

    def __init__(self, model: DFlashModel, context_window: int | None = None):
        """context_window: W, the most recent committed positions every layer attends to (None = all)."""
        config = model.config
        if context_window is not None and context_window < config.block_size:
            raise ValueError(f"context window {context_window} is smaller than the block size {config.block_size}")
        self.model, self.context_window = model, context_window
        visible = [config.visible_context(i, context_window) for i in range(config.model.num_layers)]
        self._retained = [None if v is None else v + config.block_size for v in visible]
        self._sessions: dict[str, _Mirror] = {}

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def context_length(self, session_id: str) -> int:
        """Committed positions the session's mirror covers (the next block starts there)."""
        return self._mirror(session_id).length

    @torch.inference_mode()
    def open(self, session_id: str, features: torch.Tensor, start_position: int) -> None:
        """Seed (or replace) a mirror: features [n, F] of committed tokens at start_position.. (only the
        last ones the layers can see are used)."""
        config, weight = self.model.config.model, self.model.fc.weight
        empty = [weight.new_empty(0, config.num_kv_heads, config.head_dim) for _ in self._retained]
        mirror = _Mirror(start_position, list(empty), list(empty))
        self._append([mirror], [features])
        self._sessions[session_id] = mirror

    def step(self, session_id: str, committed_features: torch.Tensor, bonus_token: int,
             step_number: int | None = None) -> torch.Tensor:
        """committed_features: [m, F] -> per-depth log-probs [B-1, V] of the block under bonus_token."""
        return self.draft_batch([DraftRequest(session_id, committed_features, bonus_token, step_number)])[0]

    def crop(self, session_id: str, num_positions: int) -> None:
        """Roll the mirror back to `num_positions` committed positions (e.g. tokens past a stop)."""
        mirror = self._mirror(session_id)
        drop = mirror.length - num_positions
        if drop < 0:
            raise ValueError(f"cannot crop session {session_id!r} of {mirror.length} positions to {num_positions}")
        mirror.keys = [k[: max(0, k.shape[0] - drop)] for k in mirror.keys]
        mirror.values = [v[: max(0, v.shape[0] - drop)] for v in mirror.values]
        mirror.length = num_positions

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    @torch.inference_mode()
    def draft_batch(self, requests: Sequence[DraftRequest | tuple]) -> torch.Tensor:
        """Commit each request's features into its mirror, then draft all sessions in one forward, whatever
        their context lengths -> log-probs [S, B-1, V]. Nothing changes if any request is invalid."""
        requests = [DraftRequest(*r) for r in requests]
        if not requests:
            head = self.model.lm_head.weight
            return torch.empty(0, self.block_size - 1, head.shape[0], device=head.device)
        mirrors = [self._mirror(r.session_id) for r in requests]
        if len({r.session_id for r in requests}) != len(requests):
            raise ValueError("a session may appear once per draft batch")
        for request, mirror in zip(requests, mirrors):
            if request.step_number is not None and mirror.last_step is not None \
                    and request.step_number <= mirror.last_step:
                raise StaleStep(f"session {request.session_id!r}: step {request.step_number} <= {mirror.last_step}")
        self._append(mirrors, [r.features for r in requests])
        for request, mirror in zip(requests, mirrors):
            if request.step_number is not None:
                mirror.last_step = request.step_number
        device = self.model.embed_tokens.weight.device
        roots = torch.tensor([r.bonus_token for r in requests], dtype=torch.long, device=device)
        starts = torch.tensor([m.length for m in mirrors], dtype=torch.long, device=device)
        contexts = [self._layer_context(mirrors, layer) for layer in range(len(self._retained))]
        return self.model.draft(roots, starts, contexts, self.context_window)

    def _mirror(self, session_id: str) -> _Mirror:
        if session_id not in self._sessions:
            raise SessionNotFound(session_id)
        return self._sessions[session_id]

    def _append(self, mirrors: list[_Mirror], features: list[torch.Tensor]) -> None:
        """Add newly committed tokens' K/V (one projection for all sessions) and trim to what is retained."""
        most = None if None in self._retained else max(self._retained)
        kept = [f[-most:] if most is not None and f.shape[0] > most else f for f in features]
        positions = [torch.arange(m.length + f.shape[0] - k.shape[0], m.length + f.shape[0])
                     for m, f, k in zip(mirrors, features, kept)]
        rows = self._kv_rows(torch.cat(kept), torch.cat(positions))
        sizes = [k.shape[0] for k in kept]
        for layer, (keys, values) in enumerate(rows):
            for mirror, k, v in zip(mirrors, keys.split(sizes), values.split(sizes)):
                mirror.keys[layer] = self._trim(torch.cat([mirror.keys[layer], k]), layer)
                mirror.values[layer] = self._trim(torch.cat([mirror.values[layer], v]), layer)
        for mirror, f in zip(mirrors, features):
            mirror.length += f.shape[0]

    def _kv_rows(self, features: torch.Tensor, positions: torch.Tensor) -> list[KeyValue]:
        # features: [N, F]; positions: [N] -> per layer (K, V) [N, Hkv, D]
        device = self.model.fc.weight.device
        return self.model.context_key_values(self.model.context_features(features.to(device)), positions.to(device))

    def _trim(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        retained = self._retained[layer]
        return rows if retained is None or rows.shape[0] <= retained else rows[-retained:]

    def _layer_context(self, mirrors: list[_Mirror], layer: int) -> LayerContext:
        keys = [m.keys[layer] for m in mirrors]
        positions = [torch.arange(m.length - k.shape[0], m.length, device=k.device) for m, k in zip(mirrors, keys)]
        return LayerContext(keys=pad_sequence(keys, batch_first=True),
                            values=pad_sequence([m.values[layer] for m in mirrors], batch_first=True),
                            positions=pad_sequence(positions, batch_first=True, padding_value=-1))
