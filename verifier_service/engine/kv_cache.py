"""The paged KV tensors of all layers and the tree scratch the verify block writes into."""

from __future__ import annotations

import torch

from modeling.config import ModelConfig


class KVCache:
    """K and V as `[L, num_pages, P, H_kv, D]`; `k[layer]` is one layer's page pool."""

    def __init__(self, model: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    @staticmethod
    def page_bytes(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * model.num_layers * page_size * model.num_kv_heads * model.head_dim * itemsize

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Duplicate whole pages in every layer (copy-on-write of a shared page)."""
        index_src = torch.tensor(src, device=self.k.device)
        index_dst = torch.tensor(dst, device=self.k.device)
        self.k[:, index_dst] = self.k[:, index_src]
        self.v[:, index_dst] = self.v[:, index_src]


class TreeScratch:
    """K and V of the current forward's tokens `[L, max_tokens, H_kv, D]`: verify blocks and prefill
    chunks land here, never in the pages; commit copies the accepted rows into the pages."""

    def __init__(self, model: ModelConfig, max_tokens: int, dtype: torch.dtype, device: torch.device | str):
        shape = (model.num_layers, max_tokens, model.num_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
