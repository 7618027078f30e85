"""Packing several sessions' verify blocks (or one prefill chunk) into one forward.

A block is a root plus nodes: row 0 is the root at position n, a node of depth d sits at n + d and
sees the whole prefix plus its ancestors and itself in the block (a prefill chunk is a chain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.tree import DraftTree
from verifier_service.engine.uploads import upload


@dataclass(frozen=True)
class BlockSpec:
    """One session's rows: tokens, depths below the root, parent rows (-1 for row 0)."""

    prefix_len: int
    tokens: list[int]
    depths: list[int]
    parent_rows: list[int]
    pages: list[int]

    @staticmethod
    def from_tree(prefix_len: int, root: int, tree: DraftTree, pages: list[int]) -> BlockSpec:
        return BlockSpec(prefix_len, [root, *tree.tokens], [0, *tree.depths],
                         [-1, *(p + 1 for p in tree.parents)], pages)

    @staticmethod
    def chain(prefix_len: int, tokens: list[int], pages: list[int]) -> BlockSpec:
        return BlockSpec(prefix_len, tokens, list(range(len(tokens))), list(range(-1, len(tokens) - 1)), pages)


@dataclass(frozen=True)
class VerifyBatch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [B, max_pages] int32
    prefix_lens: torch.Tensor  # [B] int32
    cu_tree: torch.Tensor  # [B + 1] int32
    tree_mask: torch.Tensor  # [N, W] int32 ancestor bits
    max_prefix_len: int
    max_tree_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class PrefillChunk:
    """One session's prefill chunk longer than any tree: a causal chain, so it carries no ancestor mask."""

    input_ids: torch.Tensor  # [C]
    positions: torch.Tensor  # [C]
    block_table: torch.Tensor  # [pages] int32
    prefix_len: int
    slots: torch.Tensor  # [C] int64: each position's flat page slot (page * P + offset), where its K/V go

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_prefill_chunk(block: BlockSpec, page_size: int, device: torch.device | str) -> PrefillChunk:
    positions = torch.arange(block.prefix_len, block.prefix_len + len(block.tokens))
    pages = torch.tensor(block.pages or [0])
    slots = pages[positions // page_size] * page_size + positions % page_size
    return PrefillChunk(input_ids=upload(block.tokens, torch.int64, device),
                        positions=upload(positions, torch.int64, device),
                        block_table=upload(pages, torch.int32, device),
                        prefix_len=block.prefix_len, slots=upload(slots, torch.int64, device))


def _signed32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def ancestor_words(parent_rows: list[int], num_words: int) -> list[list[int]]:
    """Per row, the bit set of its ancestors and itself, as `num_words` signed int32 words."""
    bits: list[int] = []
    for row, parent in enumerate(parent_rows):
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << row))
    return [[_signed32((b >> (32 * w)) & 0xFFFFFFFF) for w in range(num_words)] for b in bits]


def build_verify_batch(blocks: list[BlockSpec], device: torch.device | str) -> VerifyBatch:
    max_tree = max(len(b.tokens) for b in blocks)
    num_words = -(-max_tree // 32)
    max_pages = max(1, max(len(b.pages) for b in blocks))
    ids, positions, mask, tables, cu = [], [], [], [], [0]
    for block in blocks:
        ids += block.tokens
        positions += [block.prefix_len + d for d in block.depths]
        mask += ancestor_words(block.parent_rows, num_words)
        tables.append(block.pages + [0] * (max_pages - len(block.pages)))
        cu.append(cu[-1] + len(block.tokens))

    return VerifyBatch(
        input_ids=upload(ids, torch.int64, device),
        positions=upload(positions, torch.int64, device),
        block_tables=upload(tables, torch.int32, device),
        prefix_lens=upload([b.prefix_len for b in blocks], torch.int32, device),
        cu_tree=upload(cu, torch.int32, device),
        tree_mask=upload(mask, torch.int32, device),
        max_prefix_len=max(b.prefix_len for b in blocks),
        max_tree_len=max_tree,
    )
