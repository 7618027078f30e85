"""Attention backends behind one interface: the plain-torch reference (the oracle) and Triton kernels."""

from __future__ import annotations

from typing import Protocol

import torch

from ddtree_kernels import reference
from verifier_service.engine.kv_cache import KVCache, TreeScratch
from verifier_service.engine.verify_batch import PrefillChunk, VerifyBatch


class AttentionBackend(Protocol):
    def verify(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, tree_k: torch.Tensor,
               tree_v: torch.Tensor, batch: VerifyBatch, sm_scale: float) -> torch.Tensor:
        """q: [N, Hq, D]; pages: one layer's pool; tree_k/v: [N, Hkv, D] -> [N, Hq, D]."""
        ...

    def verify_latent(self, q: torch.Tensor, pages: torch.Tensor, tree_entries: torch.Tensor, batch: VerifyBatch,
                      sm_scale: float, value_dim: int) -> torch.Tensor:
        """MLA: q: [N, H, C] absorbed queries; pages: one layer's latent pool; tree_entries: [N, C]
        -> [N, H, value_dim]."""
        ...

    def prefill(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, chunk: PrefillChunk, sm_scale: float) -> torch.Tensor:
        """A long prefill chunk (GQA): q: [C, Hq, D]; k/v: [C, Hkv, D] the chunk's own -> [C, Hq, D]."""
        ...

    def prefill_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, entries: torch.Tensor,
                       chunk: PrefillChunk, w_uk: torch.Tensor, w_uv: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """A long prefill chunk (MLA, expanded): LayerAttention.latent_expanded's shapes; entries: [C, entry]."""
        ...

    def commit(self, kv: KVCache, scratch: TreeScratch, src_rows: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy scratch rows `src_rows` into page slots `dst_slots` in every layer."""
        ...


class TorchReferenceBackend:
    def verify(self, q, k_pages, v_pages, tree_k, tree_v, batch, sm_scale):
        return reference.verify_attention_reference(q, k_pages, v_pages, batch.block_tables, batch.prefix_lens,
                                                    tree_k, tree_v, batch.cu_tree, batch.tree_mask, sm_scale)

    def verify_latent(self, q, pages, tree_entries, batch, sm_scale, value_dim):
        return reference.latent_verify_attention_reference(q, pages, batch.block_tables, batch.prefix_lens,
                                                           tree_entries, batch.cu_tree, batch.tree_mask, sm_scale,
                                                           value_dim)

    def prefill(self, q, k_pages, v_pages, k, v, chunk, sm_scale):
        return reference.prefill_attention_reference(q, k_pages, v_pages, chunk.block_table, chunk.prefix_len, k, v,
                                                     sm_scale)

    def prefill_latent(self, q_nope, q_rope, pages, entries, chunk, w_uk, w_uv, sm_scale):
        return reference.latent_prefill_attention_reference(q_nope, q_rope, pages, chunk.block_table,
                                                            chunk.prefix_len, entries, w_uk, w_uv, sm_scale)

    def commit(self, kv, scratch, src_rows, dst_slots):
        for pages, rows in ((kv.k, scratch.k), (kv.v, scratch.v)):
            if pages is not None:  # NOTE: an MLA cache has no V pages
                reference.commit_rows_reference(pages, rows, src_rows, dst_slots)


class TritonBackend:
    """The hybrid verify kernels (split prefix over whole pages + masked tree block, LSE merge; GQA and MLA), the
    long-chunk prefill (fused attention, ddtree_kernels.prefill_attention) and the one-launch KV commit. Launch
    shapes come from host-side bounds: no device sync per layer."""

    def __init__(self) -> None:
        # NOTE: from the submodules: `ddtree_kernels.commit_kv` is both a submodule and a function name.
        from ddtree_kernels.commit_kv import commit_kv
        from ddtree_kernels.latent_verify import latent_verify_attention
        from ddtree_kernels.prefill_attention import latent_prefill_attention, prefill_attention
        from ddtree_kernels.verify_attention import hybrid_verify_attention

        self._verify, self._verify_latent, self._commit = hybrid_verify_attention, latent_verify_attention, commit_kv
        self._prefill, self._prefill_latent = prefill_attention, latent_prefill_attention

    def verify(self, q, k_pages, v_pages, tree_k, tree_v, batch, sm_scale):
        return self._verify(q, k_pages, v_pages, batch.block_tables, batch.prefix_lens, tree_k, tree_v,
                            batch.cu_tree, batch.tree_mask, sm_scale, batch.max_prefix_len, batch.max_tree_len)

    def verify_latent(self, q, pages, tree_entries, batch, sm_scale, value_dim):
        return self._verify_latent(q, pages, batch.block_tables, batch.prefix_lens, tree_entries,
                                   batch.cu_tree, batch.tree_mask, sm_scale, value_dim, batch.max_prefix_len,
                                   batch.max_tree_len)

    def prefill(self, q, k_pages, v_pages, k, v, chunk, sm_scale):
        return self._prefill(q, k_pages, v_pages, chunk.block_table, chunk.prefix_len, k, v, sm_scale)

    def prefill_latent(self, q_nope, q_rope, pages, entries, chunk, w_uk, w_uv, sm_scale):
        return self._prefill_latent(q_nope, q_rope, pages, chunk.block_table, chunk.prefix_len, entries, w_uk, w_uv,
                                    sm_scale)

    def commit(self, kv, scratch, src_rows, dst_slots):
        self._commit(kv.k, kv.v, scratch.k, scratch.v, src_rows, dst_slots)


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchReferenceBackend()
    if name == "triton":
        return TritonBackend()
    raise ValueError(f"attention backend must be 'torch' or 'triton', got {name!r}")


class PagedVerifyAttention:
    """The per-layer attention the model calls during one engine forward: the block's K/V go to the
    tree scratch (never the pages), then the backend attends over pages + scratch."""

    def __init__(self, backend: AttentionBackend, kv: KVCache, scratch: TreeScratch, batch: VerifyBatch | PrefillChunk,
                 sm_scale: float, value_dim: int = 0):
        """value_dim: MLA's kv_lora_rank (the latent columns that are values); unused for GQA."""
        self.backend, self.kv, self.scratch, self.batch, self.sm_scale = backend, kv, scratch, batch, sm_scale
        self.value_dim = value_dim

    def kv_buffers(self, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.scratch.v is None:
            return None
        return self.scratch.k[layer, :num_tokens], self.scratch.v[layer, :num_tokens]

    def latent_rows(self, layer: int, num_tokens: int) -> torch.Tensor:
        return self.scratch.k[layer, :num_tokens, 0]

    def latent(self, layer: int, q: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        rows = self.latent_rows(layer, q.shape[0])
        if entries.data_ptr() != rows.data_ptr():  # NOTE: not written in place (a caller without latent_rows)
            rows.copy_(entries)
        return self.backend.verify_latent(q, self.kv.k[layer], rows, self.batch, self.sm_scale, self.value_dim)

    def latent_expanded(self, *args) -> None:
        return None  # NOTE: verify blocks attend in absorbed form

    def in_scratch(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's K/V as scratch rows (written there unless they were projected in place)."""
        n = k.shape[0]
        if k.data_ptr() != self.scratch.k[layer].data_ptr():  # not projected in place (CPU, or unfused projections)
            self.scratch.k[layer, :n] = k
        if v.data_ptr() != self.scratch.v[layer].data_ptr():
            self.scratch.v[layer, :n] = v
        return self.scratch.k[layer, :n], self.scratch.v[layer, :n]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tree_k, tree_v = self.in_scratch(layer, k, v)
        return self.backend.verify(q, self.kv.k[layer], self.kv.v[layer], tree_k, tree_v, self.batch, self.sm_scale)


class PagedPrefillAttention(PagedVerifyAttention):
    """The same for one long prefill chunk (`batch` is a PrefillChunk): causal over the chunk, no tree mask; MLA
    layers take the expanded form. A chunk's positions are all kept, so its K/V go straight to its pages, layer by
    layer, rather than through the tree scratch and a commit: the scratch need not hold a chunk, however long."""

    def kv_buffers(self, layer: int, num_tokens: int) -> None:
        return None

    def latent_rows(self, layer: int, num_tokens: int) -> None:
        return None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._into_pages(self.kv.k[layer], k)
        self._into_pages(self.kv.v[layer], v)
        return self.backend.prefill(q, self.kv.k[layer], self.kv.v[layer], k, v, self.batch, self.sm_scale)

    def latent_expanded(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor,
                        w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        self._into_pages(self.kv.k[layer], entries[:, None])
        return self.backend.prefill_latent(q_nope, q_rope, self.kv.k[layer], entries, self.batch, w_uk, w_uv,
                                           self.sm_scale)

    def _into_pages(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [C, heads, D] into one layer's pool [num_pages, P, heads, D] at the chunk's slots (the prefix part
        of the attention reads only positions before the chunk, so the order does not matter)."""
        pages.view(-1, *pages.shape[2:]).index_copy_(0, self.batch.slots, rows)
