"""The DFlash drafter behind the Drafter interface: features in, one batched forward, DDTrees out."""

from __future__ import annotations

import torch

from drafter_service.dflash_mirrors import DFlashMirrors, SessionNotFound
from drafter_service.draft_graphs import DraftGraphs
from drafter_service.drafter import DrafterInfo, StepRequest, UnknownSession
from drafter_service.tree_builder import trees_from_top_k
from modeling.dflash import DFlashModel
from modeling.tree import DraftTree


class DFlashDrafter:
    def __init__(self, model: DFlashModel, context_window: int | None, max_budget: int = 255, max_sessions: int = 64,
                 cuda_graphs: bool = True):
        """max_sessions: mirrors open at once (opening one more raises TooManySessions, a ValueError);
        cuda_graphs: replay the draft from CUDA graphs where it can (a CUDA model and a context window)."""
        config = model.config
        if model.fc.weight.is_cuda:
            for layer in model.layers:
                layer.fuse_projections()
        self.mirrors = DFlashMirrors(model, context_window, max_sessions)
        self.graphs = DraftGraphs(self.mirrors, max_budget, cuda_graphs)
        self.weight = model.fc.weight
        self.info = DrafterInfo("dflash", config.block_size, context_window, tuple(config.target_layer_ids),
                                config.feature_dim, max_budget)

    def _features(self, features: torch.Tensor | None, rows: int, field: str) -> torch.Tensor:
        if features is None:
            features = self.weight.new_zeros(0, self.info.feature_dim)
        if features.ndim != 2 or features.shape != (rows, self.info.feature_dim):
            raise ValueError(f"{field} must be [{rows}, {self.info.feature_dim}], got {list(features.shape)}")
        return features.to(device=self.weight.device, dtype=self.weight.dtype)

    def open(self, session_id: str, tokens: list[int], features: torch.Tensor | None, start_position: int) -> None:
        if features is None or features.ndim != 2:
            raise ValueError("open.features are required by the DFlash drafter ([m, F])")
        rows = features.shape[0]
        if rows > len(tokens):
            raise ValueError(f"open.features has {rows} rows for {len(tokens)} tokens")
        features = self._features(features, rows, "open.features")
        self.mirrors.open(session_id, features, start_position + len(tokens) - rows)

    def warmup(self) -> None:
        """Capture the draft graph of every batch size now, rather than in the first batch of each size."""
        self.graphs.warmup()

    def draft(self, requests: list[StepRequest]) -> list[DraftTree]:
        if not requests:
            return []
        checked = []
        for r in requests:
            if r.session_id not in self.mirrors:
                raise UnknownSession(f"session {r.session_id!r} is not open on this drafter")
            if r.position > self.mirrors.context_length(r.session_id):
                raise ValueError(f"step.position {r.position} is past the mirror's "
                                 f"{self.mirrors.context_length(r.session_id)} positions")
            checked.append(self._features(r.features, len(r.committed), "step.features"))
        for r in requests:
            if r.position < self.mirrors.context_length(r.session_id):
                self.mirrors.crop(r.session_id, r.position)  # the verifier rolled back (a stop)
        try:
            inputs = self.mirrors.commit([(r.session_id, f, r.bonus, r.step) for r, f in zip(requests, checked)])
        except SessionNotFound as error:
            raise UnknownSession(str(error)) from error
        budgets = [min(r.budget, self.info.max_budget) for r in requests]
        values, ids = self.graphs.run(inputs, max(budgets))  # [S, B-1, max budget] on the host
        return trees_from_top_k(values, ids, budgets)

    def close(self, session_id: str) -> None:
        self.mirrors.close(session_id)
