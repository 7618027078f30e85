"""Verify-block positions and ancestor masks built on the GPU, from parent rows alone.

Inside a captured verify step the host only uploads tokens, parent rows, prefix lengths and block
tables; this kernel derives what the model and the attention kernel need: each row's position
(prefix length + depth below its block's root) and its bit-packed ancestor mask (itself and every
ancestor, as bits of its block-relative row). One program per row walks up to its root.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_rows_kernel(
    parents_ptr, cu_ptr, prefix_lens_ptr, positions_ptr, mask_ptr, num_seqs, stride_mn,
    NUM_WORDS: tl.constexpr, WORDS_P2: tl.constexpr, SEQS_P2: tl.constexpr,
):
    row = tl.program_id(0)
    seqs = tl.arange(0, SEQS_P2)
    starts = tl.load(cu_ptr + seqs, mask=seqs < num_seqs, other=1 << 30)
    seq = tl.sum((starts <= row).to(tl.int32)) - 1
    end = tl.load(cu_ptr + num_seqs)
    word_ids = tl.arange(0, WORDS_P2)
    words = tl.zeros([WORDS_P2], dtype=tl.int32)
    position = tl.zeros([], dtype=tl.int64)
    if row < end:  # NOTE: rows past the last block are a captured batch's padding: position 0, no bits
        start = tl.load(cu_ptr + seq)
        depth = -1
        node = row
        while node >= start:  # NOTE: parents precede their children, so the walk ends at the root (-1 above)
            offset = node - start
            words = words | tl.where(word_ids == offset // 32, 1 << (offset % 32), 0)
            depth += 1
            node = tl.load(parents_ptr + node)
        position = tl.load(prefix_lens_ptr + seq).to(tl.int64) + depth
    tl.store(positions_ptr + row, position)
    tl.store(mask_ptr + row * stride_mn + word_ids, words, mask=word_ids < NUM_WORDS)


def tree_positions_and_mask(
    parents: torch.Tensor,  # [N] int32: the parent's row in the packed batch, -1 at a block's root
    cu_tree: torch.Tensor,  # [B + 1] int32 block starts
    prefix_lens: torch.Tensor,  # [B] int32
    positions: torch.Tensor,  # [N] int64, written
    tree_mask: torch.Tensor,  # [N, W] int32, written: the same words as `verify_batch.ancestor_words`
) -> None:
    """In-place, no host sync. Rows at or past cu_tree[B] (padding) get position 0 and an empty mask."""
    num_rows, num_words = tree_mask.shape
    if parents.shape != (num_rows,) or positions.shape != (num_rows,):
        raise ValueError("parents, positions and tree_mask must have one row per token")
    if parents.dtype != torch.int32 or cu_tree.dtype != torch.int32 or prefix_lens.dtype != torch.int32:
        raise ValueError("parents, cu_tree and prefix_lens must be int32")
    if positions.dtype != torch.int64 or tree_mask.dtype != torch.int32 or tree_mask.stride(1) != 1:
        raise ValueError("positions must be int64 and tree_mask contiguous int32 words")
    if cu_tree.shape != (prefix_lens.shape[0] + 1,):
        raise ValueError("cu_tree must be [B + 1] for prefix_lens [B]")
    if num_rows == 0:
        return
    num_seqs = prefix_lens.shape[0]
    _tree_rows_kernel[(num_rows,)](
        parents, cu_tree, prefix_lens, positions, tree_mask, num_seqs, tree_mask.stride(0),
        NUM_WORDS=num_words, WORDS_P2=triton.next_power_of_2(num_words),
        SEQS_P2=triton.next_power_of_2(max(num_seqs, 1)), num_warps=1,
    )
