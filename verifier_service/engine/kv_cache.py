"""The paged KV tensors of all layers and the tree scratch the verify block writes into.

A dense (GQA) model keeps K and V, each `[H_kv, D]` per token and layer. An MLA model keeps one latent entry
per token and layer (the normalised latent, then the rotated RoPE key), stored as a single "head" in `k`;
its values are the entry's first kv_lora_rank columns, so `v` is None.
"""

from __future__ import annotations

import torch

from modeling.config import ModelConfig


def kv_row(model: ModelConfig) -> tuple[int, int, bool]:
    """What the cache holds per token and layer: (heads, values per head, whether V is stored apart from K)."""
    if model.mla is not None:
        return 1, model.mla.latent_dim, False
    return model.num_kv_heads, model.head_dim, True


def _pair(shape: tuple[int, ...], with_v: bool, dtype: torch.dtype,
          device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    k = torch.zeros(shape, dtype=dtype, device=device)
    return k, torch.zeros(shape, dtype=dtype, device=device) if with_v else None


class KVCache:
    """`k` (and `v`) as `[L, num_pages, P, heads, D]`; `k[layer]` is one layer's page pool."""

    def __init__(self, model: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        heads, dim, with_v = kv_row(model)
        self.k, self.v = _pair((model.num_layers, num_pages, page_size, heads, dim), with_v, dtype, device)
        self.page_size = page_size

    @staticmethod
    def page_bytes(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        heads, dim, with_v = kv_row(model)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (1 + with_v) * model.num_layers * page_size * heads * dim * itemsize

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Duplicate whole pages in every layer (copy-on-write of a shared page)."""
        index_src = torch.tensor(src, device=self.k.device)
        index_dst = torch.tensor(dst, device=self.k.device)
        for pages in (self.k, self.v):
            if pages is not None:
                pages[:, index_dst] = pages[:, index_src]


class TreeScratch:
    """K and V (or the latent entries) of the current forward's tokens `[L, max_tokens, heads, D]`: verify
    blocks and prefill chunks land here, never in the pages; commit copies the accepted rows into the pages."""

    def __init__(self, model: ModelConfig, max_tokens: int, dtype: torch.dtype, device: torch.device | str):
        heads, dim, with_v = kv_row(model)
        self.k, self.v = _pair((model.num_layers, max_tokens, heads, dim), with_v, dtype, device)
