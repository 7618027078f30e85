"""The DFlash drafter behind the Drafter interface: features in, one batched forward, DDTrees out."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ddtree.progress import track
from drafter_service.dflash_mirrors import DFlashMirrors
from drafter_service.draft_graphs import DraftGraphs
from drafter_service.drafter import DrafterInfo
from drafter_service.errors import SessionNotFound
from drafter_service.tree_builder import GPU_TREES_FROM, draft_trees, top_k_log_probs
from modeling.dflash import DFlashModel
from modeling.speculation import DrafterSeed, DraftStep
from modeling.tree import DraftTree


class DFlashDrafter:
    def __init__(self, model: DFlashModel, context_window: int | None, max_budget: int = 255, max_sessions: int = 64,
                 cuda_graphs: bool = True):
        """max_sessions: mirrors open at once (opening one more raises TooManySessions);
        cuda_graphs: replay the draft from CUDA graphs where it can (a CUDA model and a context window)."""
        config = model.config
        if model.fc.weight.is_cuda:
            model.fuse_projections()
        self.mirrors = DFlashMirrors(model, context_window, max_sessions)
        self.graphs = DraftGraphs(self.mirrors, cuda_graphs)
        self.weight = model.fc.weight
        self.info = DrafterInfo("dflash", config.block_size, context_window, tuple(config.target_layer_ids),
                                config.feature_dim, max_budget, str(self.weight.dtype).removeprefix("torch."),
                                str(self.weight.device), max_sessions)

    def _features(self, features: torch.Tensor | None, rows: int, field: str) -> torch.Tensor:
        if features is None:
            features = self.weight.new_zeros(0, self.info.feature_dim)
        if features.ndim != 2 or features.shape != (rows, self.info.feature_dim):
            raise ValueError(f"{field} must be [{rows}, {self.info.feature_dim}], got {list(features.shape)}")
        return features.to(dtype=self.weight.dtype)  # NOTE: left where it is: the commit moves all rows at once

    def open(self, session_id: str, seed: DrafterSeed) -> None:
        if seed.features is None or seed.features.ndim != 2:
            raise ValueError("open.features are required by the DFlash drafter ([m, F])")
        rows = seed.features.shape[0]
        if rows > len(seed.tokens):
            raise ValueError(f"open.features has {rows} rows for {len(seed.tokens)} tokens")
        features = self._features(seed.features, rows, "open.features")
        self.mirrors.open(session_id, features, seed.start_position + len(seed.tokens) - rows)

    @property
    def captured_graphs(self) -> int:
        return len(self.graphs.captured) + len(self.graphs.committers)

    def warmup(self) -> None:
        """Capture the draft graph of every batch size now, rather than in the first batch of each size; on a GPU,
        compile the top-k and tree kernels for every budget's power of two too (a compile takes about a second)."""
        self.graphs.warmup(functools.partial(track, task="capturing draft CUDA graphs", unit="graphs"))
        if self.weight.is_cuda:
            vocab = self.mirrors.model.lm_head.weight.shape[0]
            logits = self.weight.new_zeros(GPU_TREES_FROM, self.mirrors.block_size - 1, vocab)
            most = self.info.max_budget  # NOTE: a budget compiles the kernels for its next power of two
            for budget in [min(1 << p, most) for p in range((most - 1).bit_length() + 1)] if most > 0 else []:
                draft_trees(*top_k_log_probs(logits, budget), [budget] * GPU_TREES_FROM)

    def draft(self, steps: list[DraftStep]) -> list[DraftTree]:
        if not steps:
            return []
        checked = []
        for step in steps:
            if step.session_id not in self.mirrors:
                raise SessionNotFound(f"session {step.session_id!r} is not open on this drafter")
            length = self.mirrors.context_length(step.session_id)
            if step.position > length:
                raise ValueError(f"step.position {step.position} is past the mirror's {length} positions")
            checked.append(replace(step, features=self._features(step.features, len(step.committed),
                                                                 "step.features")))
        for step in steps:
            if step.position < self.mirrors.context_length(step.session_id):
                self.mirrors.crop(step.session_id, step.position)  # the verifier rolled back (a stop)
        batch = self.mirrors.commit(checked, self.graphs.write)
        budgets = [min(s.budget, self.info.max_budget) for s in steps]
        values, ids = self.graphs.draft(batch, max(1, *budgets))  # [S, B-1, K] on the drafter's device
        return draft_trees(values, ids, budgets)

    def close(self, session_id: str) -> None:
        self.mirrors.close(session_id)
