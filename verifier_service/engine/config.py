"""Engine configuration: frozen, derived values as properties."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.config import parse_dtype

PAGE_SIZES = (16, 32, 64, 128, 256)
TRITON_MAX_BLOCK = 256  # tokens of one verify block in the Triton kernels (a tree, or a prefill chunk this short)
LONG_PREFILL_CHUNK = 4096  # on CUDA: benchmarks/results/prefill.md (dense), prefill_deepseek-v2-lite.md (MLA)


ATTENTION_CHOICES = ("auto", "torch", "triton")


def resolve_attention(choice: str, device: str) -> str:
    """`auto`: the Triton kernels (and CUDA graphs) on CUDA, the torch reference on the CPU."""
    if choice != "auto":
        return choice
    return "triton" if torch.device(device).type == "cuda" else "torch"


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 64
    kv_budget_bytes: int = 256 << 20  # K and V pages of all layers together
    max_tree_nodes: int = 255  # draft nodes per tree (the verify block holds one more: the root)
    prefill_chunk: int | None = None  # None: LONG_PREFILL_CHUNK on CUDA, else TRITON_MAX_BLOCK
    # NOTE: a multiple of the prefill chunk: chunks of this many tokens while nobody else waits for the engine (no
    # generation stepping, no other prompt waiting), where larger chunks run nearer the matmul rate; None: off
    lone_prefill_chunk: int | None = None
    max_batch_tokens: int = 2048  # rows of one step's verify blocks together (the tree scratch's rows)
    max_batch_sessions: int = 256  # sessions in one step; more wait for the next (verifier_service/step_loop.py)
    max_context: int | None = None  # defaults to the model's max_position_embeddings
    dtype: str = "float32"
    device: str = "cpu"
    attention: str = "torch"  # torch (reference) | triton
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states feed the drafter
    cuda_graphs: bool = True  # replay captured forwards (CUDA with the triton backend only)
    graph_max_sessions: int = 256  # larger batches run eagerly (as many as max_batch_sessions by default)
    # NOTE: plain decoding steps per engine call when every session of a batch decodes plainly (Engine.decode): the
    # host's work per call then serves this many tokens, which reach the client in bursts of as many
    decode_burst_steps: int = 1
    # NOTE: prompt rows whose logits are computed at once for prompt logprobs: [rows, V] fp32 logits and their
    # log_softmax live together, about 0.6 GB at 512 rows of a 152k vocab
    prompt_logprob_rows: int = 512
    # NOTE: released sessions' full KV pages stay indexed by their tokens until their room is needed, and a new
    # session's prompt starts from the longest run of them it begins with (engine/prefix_cache.py)
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be one of {PAGE_SIZES}, got {self.page_size}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if self.lone_prefill_chunk is not None and self.lone_prefill_chunk % self.prefill_chunk_tokens:
            raise ValueError(f"lone_prefill_chunk ({self.lone_prefill_chunk}) must be a multiple of the prefill "
                             f"chunk ({self.prefill_chunk_tokens})")
        if self.max_tree_nodes + 1 > self.max_batch_tokens:
            raise ValueError("max_tree_nodes + 1 must fit in max_batch_tokens")
        if min(self.graph_max_sessions, self.max_batch_sessions, self.decode_burst_steps,
               self.prompt_logprob_rows) < 1:
            raise ValueError("graph_max_sessions, max_batch_sessions, decode_burst_steps and prompt_logprob_rows must "
                             "be >= 1")
        parse_dtype(self.dtype)
        if self.attention not in ("torch", "triton"):
            raise ValueError(f"attention must be 'torch' or 'triton', got {self.attention!r}")
        if self.attention == "triton" and self.max_tree_tokens > TRITON_MAX_BLOCK:
            raise ValueError(f"the triton backend verifies trees of at most {TRITON_MAX_BLOCK} tokens: "
                             "lower max_tree_nodes")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def max_tree_tokens(self) -> int:
        return self.max_tree_nodes + 1

    @property
    def prefill_chunk_tokens(self) -> int:
        """The prefill chunk: on CUDA long chunks, a causal chain through the fused prefill attention (MLA models
        in its expanded form: 2.8x the latent verify kernel's 256-token blocks on a 128k prompt,
        benchmarks/results/prefill_deepseek-v2-lite.md); elsewhere blocks of the verify kernels' size."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return LONG_PREFILL_CHUNK if torch.device(self.device).type == "cuda" else TRITON_MAX_BLOCK

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.cuda_graphs and self.attention == "triton" and torch.device(self.device).type == "cuda"
