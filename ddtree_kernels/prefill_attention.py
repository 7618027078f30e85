"""Causal attention of one long prefill chunk over its paged prefix, at the matmul rate.

The verify kernels treat a block as a tree (ancestor bits per row, at most 256 rows), which made a 128k
prefill 512 chunks of 256 tokens. A prefill chunk is a chain, so it needs no mask beyond causality and can be
thousands of rows long. It runs as two fused attentions with their log-sum-exps, merged:

- the chunk's queries against the whole prefix, with no mask. The query heads of one KV group are folded into
  the query length ([H_kv, G * C, D] against [H_kv, S, D]), so the prefix is read once per group and never
  copied per head;
- the chunk against itself, causal (GQA: each KV head serves its group of query heads; C rows, small next
  to the prefix).

On CUDA both run in cuDNN's fused attention through torch: measured on an H200 at ~600 TFLOP/s for chunks of
4k-8k tokens over a 128k prefix (77% of the bf16 matmul rate; the Triton verify kernel on 256-row blocks and
FlashAttention-2 through torch reach ~350-420). Elsewhere (the CPU, or no cuDNN) the same split runs in plain
torch (fp32 math), which is also what the tests check the merge with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_kernels.reference import gather_prefix


def fused_attention_available(device: torch.device) -> bool:
    """Whether cuDNN's fused attention (with its log-sum-exp) can run on this device."""
    return (device.type == "cuda" and torch.backends.cudnn.is_available()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [H, L, D], k: [H_k, S, D], v: [H_k, S, Dv] (any strides with a contiguous last dim; H a multiple of H_k,
    query head h attending with key head h // (H / H_k)) -> out [H, L, Dv] in q's dtype and the fp32 log-sum-exp
    [H, L]. Causal aligns the first query with the first key (L == S here)."""
    if fused_attention_available(q.device) and q.dtype in (torch.bfloat16, torch.float16):
        value_dim = v.shape[-1]
        if value_dim != q.shape[-1]:  # NOTE: MLA's narrower values, zero-padded to the key width
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - value_dim))
        # NOTE: cuDNN takes fewer key heads as they are (GQA): K/V repeated per query head cost a copy of both
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q[None], k[None], v[None], None, True, 0.0, causal, False, scale=sm_scale)[:2]
        return out[0, ..., :value_dim], lse.reshape(q.shape[:2]).float()
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0).float(), v.repeat_interleave(group, 0).float()
    scores = torch.einsum("hld,hsd->hls", q.float(), k) * sm_scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("hls,hsd->hld", torch.exp(scores - lse[..., None]), v).to(q.dtype), lse


@triton.jit
def _merge_kernel(a_ptr, a_lse_ptr, b_ptr, b_lse_ptr, out_ptr, rows, a_head, a_row, b_head, b_row, lse_a_head,
                  lse_b_head, out_head, out_row, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """BLOCK_ROWS rows of one head of two attentions over disjoint keys, weighted by their log-sum-exps (one read
    of each, any row and head strides: the fused attentions' outputs are read and the result written in the
    layouts they and the caller keep, with no copy between)."""
    head = tl.program_id(1).to(tl.int64)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    inside = row < rows
    dims = tl.arange(0, HEAD_DIM)[None, :]
    a_lse = tl.load(a_lse_ptr + head * lse_a_head + row, mask=inside, other=0.0)
    b_lse = tl.load(b_lse_ptr + head * lse_b_head + row, mask=inside, other=0.0)
    a_weight = (1.0 / (1.0 + tl.exp(b_lse - a_lse)))[:, None]
    a = tl.load(a_ptr + head * a_head + row[:, None] * a_row + dims, mask=inside[:, None]).to(tl.float32)
    b = tl.load(b_ptr + head * b_head + row[:, None] * b_row + dims, mask=inside[:, None]).to(tl.float32)
    tl.store(out_ptr + head * out_head + row[:, None] * out_row + dims,
             (b + (a - b) * a_weight).to(out_ptr.dtype.element_ty), mask=inside[:, None])


PREFIX_SEGMENT = 32768  # NOTE: MLA prefix tokens expanded at once: 128 heads' K and V of 32k tokens are ~3 GB
MERGE_ROWS = 32  # NOTE: rows of one head per program: 4k elements, enough to stream at the copy bandwidth


def merge_by_lse(a: torch.Tensor, a_lse: torch.Tensor, b: torch.Tensor, b_lse: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """a, b: [H, L, D] with fp32 lse [H, L] -> the attention over both key sets, in a's dtype, written into `out`
    ([H, L, D], any head and row strides; a new contiguous tensor by default)."""
    if out is None:
        out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if a.is_cuda and triton.next_power_of_2(a.shape[-1]) == a.shape[-1]:
        heads, rows, dim = a.shape
        a_lse, b_lse = a_lse.contiguous(), b_lse.contiguous()
        for tensor in (a, b, out):
            assert tensor.stride(-1) == 1, "merge_by_lse: the last dimension must be contiguous"
        _merge_kernel[(triton.cdiv(rows, MERGE_ROWS), heads)](
            a, a_lse, b, b_lse, out, rows, a.stride(0), a.stride(1), b.stride(0), b.stride(1), a_lse.stride(0),
            b_lse.stride(0), out.stride(0), out.stride(1), HEAD_DIM=dim, BLOCK_ROWS=MERGE_ROWS, num_warps=4)
        return out
    a_weight = torch.sigmoid(a_lse - b_lse)[..., None]
    return out.copy_(b.float().lerp_(a.float(), a_weight))


def build_plans(heads: int, kv_heads: int, dim: int, chunk: int, max_prefix: int, dtype: torch.dtype,
                device: torch.device) -> int:
    """Run the fused attention once at every shape a full chunk can meet (prefix lengths: the multiples of
    `chunk` up to `max_prefix`), so that cuDNN builds those plans (~40 ms each) at start rather than inside a
    client's time to first token. Returns the shapes run (0 where the fused attention is not used)."""
    if not fused_attention_available(device) or dtype not in (torch.bfloat16, torch.float16):
        return 0
    group = heads // kv_heads
    keys = torch.zeros(max(max_prefix, chunk), kv_heads, dim, dtype=dtype, device=device)
    by_head = torch.zeros(chunk, heads, dim, dtype=dtype, device=device).transpose(0, 1)  # NOTE: as prefill's strides
    chunk_keys = keys[:chunk].transpose(0, 1)
    attention_with_lse(by_head, chunk_keys, chunk_keys, True, 1.0)
    folded = torch.zeros(kv_heads, group * chunk, dim, dtype=dtype, device=device)
    prefix_lens = range(chunk, max_prefix + 1, chunk)
    for prefix_len in prefix_lens:
        prefix = keys[:prefix_len].transpose(0, 1)  # NOTE: the strides of a gathered prefix, as the plans key on
        attention_with_lse(folded, prefix, prefix, False, 1.0)
    return 1 + len(prefix_lens)


def latent_segments(chunk: int, max_prefix: int, segment: int) -> list[int]:
    """The lengths of the prefix segments `latent_prefill_attention` expands for the full chunks of a prompt up to
    `max_prefix` + `chunk` tokens (prefixes at the multiples of `chunk`)."""
    lengths = {prefix % segment or segment for prefix in range(chunk, max_prefix + 1, chunk)}
    return sorted(lengths | ({segment} if max_prefix > segment else set()))


def build_latent_plans(w_uk: torch.Tensor, w_uv: torch.Tensor, rope_dim: int, chunk: int, max_prefix: int,
                       segment: int = PREFIX_SEGMENT) -> int:
    """`build_plans` for an MLA model's expanded prefill (`latent_prefill_attention`): its causal chunk and every
    prefix segment length a full chunk meets, at the strides that function gives them. Returns the shapes run."""
    if not fused_attention_available(w_uk.device) or w_uk.dtype not in (torch.bfloat16, torch.float16):
        return 0
    heads, nope, rank = w_uk.shape
    lengths = latent_segments(chunk, max_prefix, segment)
    entries = torch.zeros(max([chunk, *lengths]), rank + rope_dim, dtype=w_uk.dtype, device=w_uk.device)
    query = torch.zeros(chunk, heads, nope + rope_dim, dtype=w_uk.dtype, device=w_uk.device).transpose(0, 1)
    weights = expansion_weights(w_uk, w_uv, rope_dim)
    attention_with_lse(query, *expand_latents(entries[:chunk], weights), True, 1.0)
    for length in lengths:
        attention_with_lse(query, *expand_latents(entries[:length], weights), False, 1.0)
    return 1 + len(lengths)


def prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                      prefix_len: int, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q: [C, H_q, D] of positions prefix_len .. prefix_len + C - 1; k/v: [C, H_kv, D] the chunk's own keys and
    values; pages: one layer's pool [num_pages, P, H_kv, D]; block_table: [pages] of the sequence
    -> [C, H_q, D]."""
    chunk, heads, dim = q.shape
    group = heads // k.shape[1]
    by_head = q.transpose(0, 1)  # [H_q, C, D]
    out, lse = attention_with_lse(by_head, k.transpose(0, 1), v.transpose(0, 1), True, sm_scale)
    if prefix_len == 0:
        return out.transpose(0, 1)
    folded = by_head.reshape(-1, group * chunk, dim)  # [H_kv, G * C, D]: head h is row block h % G of h // G
    prefix_k = gather_prefix(k_pages, block_table, prefix_len).transpose(0, 1)  # [H_kv, S, D]
    prefix_v = gather_prefix(v_pages, block_table, prefix_len).transpose(0, 1)
    prefix_out, prefix_lse = attention_with_lse(folded, prefix_k, prefix_v, False, sm_scale)
    merged = torch.empty_like(q)  # NOTE: [C, H, D], as the output projection reads it
    merge_by_lse(out, lse, prefix_out.reshape(heads, chunk, dim), prefix_lse.reshape(heads, chunk),
                 out=merged.transpose(0, 1))
    return merged


def expansion_weights(w_uk: torch.Tensor, w_uv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """kv_b_proj's halves W_UK [H, nope, r] and W_UV [H, v, r] as one [r + rope, 2, H, nope + rope] matrix that
    turns MLA cache entries [L, r + rope] into every head's key [latent W_UK^T | shared RoPE key] and value (zero-
    padded to the key width, as cuDNN takes values) in one GEMM: the RoPE key passes through an identity block
    (exact in any dtype), where building keys from a narrower GEMM's output and the RoPE key copied both again."""
    heads, nope, rank = w_uk.shape
    weights = w_uk.new_zeros(rank + rope_dim, 2, heads, nope + rope_dim)
    weights[:rank, 0, :, :nope] = w_uk.permute(2, 0, 1)
    weights[rank:, 0, :, nope:] = torch.eye(rope_dim, dtype=w_uk.dtype, device=w_uk.device)[:, None]
    weights[:rank, 1, :, :w_uv.shape[1]] = w_uv.permute(2, 0, 1)
    return weights


def expand_latents(entries: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA cache entries [L, r + rope] -> per-head keys [H, L, nope + rope] and values [H, L, nope + rope] (the
    first v_head_dim columns real), views of one GEMM's [L, 2, H, nope + rope] output (`expansion_weights`)."""
    out = (entries @ weights.flatten(1)).view(entries.shape[0], *weights.shape[1:])
    return out[:, 0].transpose(0, 1), out[:, 1].transpose(0, 1)


def latent_prefill_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor,
                             block_table: torch.Tensor, prefix_len: int, entries: torch.Tensor, w_uk: torch.Tensor,
                             w_uv: torch.Tensor, sm_scale: float, segment: int = PREFIX_SEGMENT) -> torch.Tensor:
    """An MLA model's long prefill chunk, expanded rather than absorbed: the absorbed form costs
    2 x (kv_lora_rank + rope + kv_lora_rank) FLOPs per query head and key, the expanded one 2 x (nope + rope + v)
    (1088 against 320 for DeepSeek / GLM shapes) at the fused attention's rate, plus expanding the prefix through
    kv_b_proj once per chunk (~17% more at a 4k chunk: one GEMM, `expansion_weights`). The prefix is expanded
    `segment` tokens at a time (its per-head K/V would not fit at once for 128 heads), each segment's attention
    merged by log-sum-exp.

    q_nope: [C, H, nope], q_rope: [C, H, rope] rotated; pages: one layer's latent pool [num_pages, P, 1, entry];
    entries: [C, entry] the chunk's own -> [C, H, v_head_dim]."""
    query = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, C, nope + rope]
    weights = expansion_weights(w_uk, w_uv, q_rope.shape[-1])
    out, lse = attention_with_lse(query, *expand_latents(entries, weights), True, sm_scale)
    prefix = gather_prefix(pages, block_table, prefix_len)[:, 0] if prefix_len else entries[:0]
    for start in range(0, prefix_len, segment):
        part, part_lse = attention_with_lse(query, *expand_latents(prefix[start:start + segment], weights), False,
                                            sm_scale)
        out, lse = merge_by_lse(out, lse, part, part_lse), torch.logaddexp(lse, part_lse)
    return out[..., :w_uv.shape[1]].transpose(0, 1)
