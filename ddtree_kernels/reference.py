"""Plain-torch references for the attention and KV-commit kernels: the oracle in every test.

Layout shared with the Triton kernels:
- pages: `[num_pages, P, H_kv, D]` per layer; token p of a sequence lives in page
  `block_table[p // P]`, slot `p % P`.
- a batch of B sequences verifies N packed tree tokens; sequence b owns rows `cu_tree[b]:cu_tree[b+1]`
  of `q`, `tree_k`, `tree_v` and `tree_mask`.
- `tree_mask[r, w]` (int32 words): bit j of word w is set when row r may attend to its sequence's
  tree token `32 * w + j` (ancestors and itself). The whole prefix is always visible.
- MLA (latent attention): one page pool per layer `[num_pages, P, 1, C]` holds each token's latent entry
  (normalised latent, then rotated RoPE key: C = kv_lora_rank + rope dim); every head attends over the same
  entries, and the values are their first kv_lora_rank columns.
"""

from __future__ import annotations

import torch


def gather_prefix(pages: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Dense `[length, H_kv, D]` view of one sequence's first `length` positions."""
    page_size = pages.shape[1]
    num_pages = (length + page_size - 1) // page_size
    return pages[block_table[:num_pages].long()].flatten(0, 1)[:length]


def unpack_tree_mask(words: torch.Tensor, length: int) -> torch.Tensor:
    """`[R, W]` int32 words -> `[R, length]` bool."""
    bits = torch.arange(length, device=words.device)
    selected = words[:, bits // 32].to(torch.int64)
    return ((selected >> (bits % 32)) & 1).bool()


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """`[R, T]` bool -> `[R, ceil(T / 32)]` int32 words (the inverse of unpack_tree_mask)."""
    rows, length = mask.shape
    num_words = max(1, (length + 31) // 32)
    padded = torch.zeros(rows, num_words * 32, dtype=torch.int64, device=mask.device)
    padded[:, :length] = mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    words = (padded.view(rows, num_words, 32) * weights).sum(-1)
    # NOTE: reinterpret the low 32 bits as signed int32 (bit 31 set -> negative word).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def verify_attention_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               block_tables: torch.Tensor, prefix_lens: torch.Tensor, tree_k: torch.Tensor,
                               tree_v: torch.Tensor, cu_tree: torch.Tensor, tree_mask: torch.Tensor,
                               sm_scale: float) -> torch.Tensor:
    """Each tree row attends to its whole prefix plus the tree tokens its mask allows (fp32 math). The
    arguments and shapes are `verify_attention.hybrid_verify_attention`'s, without its launch bounds."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_pages.shape[2]
    for b in range(block_tables.shape[0]):
        lo, hi = int(cu_tree[b]), int(cu_tree[b + 1])
        if hi == lo:
            continue
        n = int(prefix_lens[b])
        keys = torch.cat([gather_prefix(k_pages, block_tables[b], n), tree_k[lo:hi]]).float()
        values = torch.cat([gather_prefix(v_pages, block_tables[b], n), tree_v[lo:hi]]).float()
        visible = torch.cat([torch.ones(hi - lo, n, dtype=torch.bool, device=q.device),
                             unpack_tree_mask(tree_mask[lo:hi], hi - lo)], dim=1)  # [T, n + T]
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[lo:hi].float(), keys) * sm_scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[lo:hi] = torch.einsum("hts,shd->thd", scores.softmax(-1), values).to(q.dtype)
    return out


def prefill_attention_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                block_table: torch.Tensor, prefix_len: int, k: torch.Tensor, v: torch.Tensor,
                                sm_scale: float) -> torch.Tensor:
    """A prefill chunk: row i sees the whole prefix and chunk rows 0..i (fp32 math). The arguments and shapes are
    `prefill_attention.prefill_attention`'s."""
    chunk, group = q.shape[0], q.shape[1] // k.shape[1]
    keys = torch.cat([gather_prefix(k_pages, block_table, prefix_len), k]).float().repeat_interleave(group, dim=1)
    values = torch.cat([gather_prefix(v_pages, block_table, prefix_len), v]).float().repeat_interleave(group, dim=1)
    positions = torch.arange(prefix_len + chunk, device=q.device)
    visible = positions <= positions[prefix_len:, None]  # [C, S + C]
    scores = torch.einsum("thd,shd->hts", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), values).to(q.dtype)


def _latent_partial(q: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor | None, sm_scale: float,
                    value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, H, C] over entries [S, C] (fp32) -> output [T, H, value_dim] and its LSE [T, H]
    (zeros and -inf when there are no entries; a row with entries sees at least one)."""
    scores = torch.einsum("thc,sc->ths", q, entries) * sm_scale
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("ths,sv->thv", probs, entries[:, :value_dim]), lse


def latent_verify_attention_reference(q: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor,
                                      prefix_lens: torch.Tensor, tree_entries: torch.Tensor, cu_tree: torch.Tensor,
                                      tree_mask: torch.Tensor, sm_scale: float, value_dim: int) -> torch.Tensor:
    """MLA verify in absorbed form, as the hybrid kernel splits it: each row's attention over its whole prefix
    (no mask) and over the tree block (its mask), merged by their log-sum-exps (fp32 math).

    q: [N, H, C] absorbed queries; pages: [num_pages, P, 1, C]; tree_entries: [N, C] -> [N, H, value_dim].
    """
    out = q.new_empty(*q.shape[:2], value_dim)
    for b in range(block_tables.shape[0]):
        lo, hi = int(cu_tree[b]), int(cu_tree[b + 1])
        if hi == lo:
            continue
        rows = q[lo:hi].float()
        prefix = gather_prefix(pages, block_tables[b], int(prefix_lens[b]))[:, 0].float()
        visible = unpack_tree_mask(tree_mask[lo:hi], hi - lo)
        prefix_out, prefix_lse = _latent_partial(rows, prefix, None, sm_scale, value_dim)
        tree_out, tree_lse = _latent_partial(rows, tree_entries[lo:hi].float(), visible, sm_scale, value_dim)
        lse = torch.logaddexp(prefix_lse, tree_lse)  # the tree row sees itself: finite
        out[lo:hi] = (prefix_out * torch.exp(prefix_lse - lse)[..., None]
                      + tree_out * torch.exp(tree_lse - lse)[..., None]).to(q.dtype)
    return out


def latent_prefill_attention_reference(q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor,
                                       block_table: torch.Tensor, prefix_len: int, entries: torch.Tensor,
                                       w_uk: torch.Tensor, w_uv: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """An MLA prefill chunk in absorbed form (the verify path's math, causal over the chunk; fp32): the arguments
    and shapes are `prefill_attention.latent_prefill_attention`'s."""
    chunk, rank = q_nope.shape[0], w_uk.shape[-1]
    query = torch.cat([torch.einsum("chd,hdr->chr", q_nope.float(), w_uk.float()), q_rope.float()], dim=-1)
    keys = torch.cat([gather_prefix(pages, block_table, prefix_len)[:, 0], entries]).float()
    positions = torch.arange(prefix_len + chunk, device=q_nope.device)
    visible = positions <= positions[prefix_len:, None]  # [C, S + C]
    latents, _ = _latent_partial(query, keys, visible, sm_scale, rank)
    return torch.einsum("chr,hvr->chv", latents, w_uv.float()).to(q_nope.dtype)


def commit_rows_reference(pages: torch.Tensor, rows: torch.Tensor, src_rows: torch.Tensor,
                          dst_slots: torch.Tensor) -> None:
    """Copy rows `src_rows` of one scratch tensor `[L, N, ...]` into the page slots `dst_slots` of its pool
    `[L, num_pages, P, ...]`, in every layer."""
    num_layers, num_pages, page_size = pages.shape[:3]
    pages.view(num_layers, num_pages * page_size, *pages.shape[3:])[:, dst_slots.long()] = rows[:, src_rows.long()]


def commit_kv_reference(k_pages: torch.Tensor, v_pages: torch.Tensor, tree_k: torch.Tensor, tree_v: torch.Tensor,
                        src_rows: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy accepted rows of the tree scratch into their page slots, for every layer (the arguments and shapes
    are `commit_kv.commit_kv`'s)."""
    for pages, tree in ((k_pages, tree_k), (v_pages, tree_v)):
        commit_rows_reference(pages, tree, src_rows, dst_slots)
