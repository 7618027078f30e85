"""The draft block attention kernel (ddtree_kernels/draft_attention.py) against the torch path it replaces on CUDA
(modeling.dflash.block_attention).

Without CUDA the kernel runs in Triton's CPU interpreter (fp32/fp16, small shapes: the interpreter gives wrong
bf16 dot products); with CUDA the `gpu` tests run bf16 at the Qwen3-8B drafter's shape, a CUDA-graph replay and
whole drafts. Every case poisons with NaN what the kernel must never read: the slots' spare rows (the block's K/V
come from the projection) and the rows no query may see (empty, or before the serving window).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ddtree_kernels.draft_attention as draft_attention
from ddtree_kernels.draft_attention import BLOCK_N, MAX_SPLITS, draft_block_attention, plan_splits
from modeling.dflash import DFlashConfig, DFlashModel, LayerContext, block_attention

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on CPU machines")
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1.5e-2, 2e-2)}
LAYERS = {  # layer kind -> (sliding window, causal)
    "full": (None, False),
    "full-causal": (None, True),
    "sliding": (5, False),
    "sliding-causal": (7, True),
}


def ring_positions(lengths: list[int], capacity: int) -> torch.Tensor:
    """[N, C]: slot i holds the last `capacity` of its lengths[i] positions, position p in ring row p % C."""
    positions = torch.full((len(lengths), capacity), -1, dtype=torch.long)
    for slot, length in enumerate(lengths):
        held = torch.arange(max(0, length - capacity), length)
        positions[slot, held % capacity] = held
    return positions


def make_case(lengths: list[int], slots: list[int], capacity: int, block: int, heads: tuple[int, int],
              head_dim: int, dtype: torch.dtype, serving_window: int | None, seed: int) -> dict:
    """Slot buffers of len(lengths) sessions and a draft of the sessions `slots` (a repeat is a padded batch's
    copy of its first session); q, k and v are strided views of one projection output, as the model's are."""
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    shape = (len(lengths), capacity + block, num_kv_heads, head_dim)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    positions = ring_positions(lengths, capacity)
    starts = torch.tensor(lengths)[slots]  # [S]: the block sits at n..n+B-1
    block_pos = starts[:, None] + torch.arange(block)
    context_start = (starts - serving_window).clamp(min=0) if serving_window else torch.zeros_like(starts)
    qkv = torch.randn(len(slots) * block, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen)
    case = dict(q=qkv[:, :num_q_heads], k=qkv[:, num_q_heads:-num_kv_heads], v=qkv[:, -num_kv_heads:], keys=keys,
                values=values, positions=positions, slots=torch.tensor(slots), block_pos=block_pos,
                context_start=context_start)
    return {name: t.to(DEVICE, dtype if t.is_floating_point() else t.dtype) for name, t in case.items()}


def poison_unread_rows(case: dict) -> None:
    """NaN in the spare rows and in every row a drafted slot hides (empty or before its serving window)."""
    for buffer in (case["keys"], case["values"]):
        capacity = case["positions"].shape[1]
        buffer[:, capacity:] = float("nan")
        for slot, start in zip(case["slots"].tolist(), case["context_start"].tolist()):
            buffer[slot, :capacity][case["positions"][slot] < start] = float("nan")


def torch_path(case: dict, window: int | None, causal: bool) -> torch.Tensor:
    """The torch path in fp32 over the case's buffers with NaN read as 0 (it gathers every row)."""
    upcast = {name: t.float().nan_to_num(0.0) if t.is_floating_point() else t for name, t in case.items()}
    context = LayerContext(upcast["keys"], upcast["values"], upcast["positions"])
    return block_attention(upcast["q"], upcast["k"], upcast["v"], context, upcast["slots"], upcast["block_pos"],
                           upcast["context_start"], window, causal)


def check(case: dict, window: int | None, causal: bool, block_n: int = BLOCK_N) -> None:
    expected = torch_path(case, window, causal)
    poison_unread_rows(case)
    out = draft_block_attention(**case, window=window, causal=causal, block_n=block_n)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.fixture
def sms(monkeypatch: pytest.MonkeyPatch):
    """Sets the SM count the split plan fills (the interpreter's stand-in is 4): few SMs, one split."""
    def set_count(count: int) -> None:
        monkeypatch.setattr(draft_attention, "multiprocessor_count", lambda device: count)
    return set_count


# lengths of the slots' sessions, drafted slots, capacity C, block B, (Hq, Hkv), D, dtype, serving window W,
# layer kind, SMs (splits follow)
CPU_CASES = {
    "one-split": ([3, 57, 40, 100, 12], [3, 0, 1, 4], 40, 5, (6, 2), 16, torch.float32, 20, "full", 1),
    "splits-sliding-causal": ([3, 57, 40, 100, 12], [3, 0, 1, 4], 40, 5, (6, 2), 16, torch.float16, 20,
                              "sliding-causal", 16),
    "padded-batch": ([3, 57, 40, 100, 12], [1, 4, 1, 1], 40, 5, (6, 2), 16, torch.float16, None, "full", 8),
    "sliding-d64": ([200, 9], [1, 0], 48, 8, (4, 1), 64, torch.float16, 30, "sliding", 4),
    "two-query-blocks": ([30, 5], [0, 1], 24, 9, (16, 1), 16, torch.float32, None, "full-causal", 4),
}


@cpu_only
@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_kernel_matches_the_torch_path_interpreter(name: str, sms) -> None:
    lengths, slots, capacity, block, heads, head_dim, dtype, serving_window, layer, count = CPU_CASES[name]
    sms(count)
    case = make_case(lengths, slots, capacity, block, heads, head_dim, dtype, serving_window, seed=len(name))
    check(case, *LAYERS[layer], block_n=16)  # small key blocks: short rings still span several splits


def test_split_plan_fills_the_gpu_with_whole_key_blocks(sms) -> None:
    sms(132)
    keys = 1024 + 16  # the Qwen3-8B drafter's ring (W = 1008) and block
    assert plan_splits(8, keys, DEVICE) == (17, BLOCK_N)  # one session: every key block its own split
    assert plan_splits(3 * 8, keys, DEVICE) == (9, 2 * BLOCK_N)
    assert plan_splits(64 * 8, keys, DEVICE) == (1, 17 * BLOCK_N)  # enough tiles: no split, no merge
    for tiles in range(1, 600, 7):
        for num_keys in (1, 16, 65, 1040, 70000):
            splits, split_len = plan_splits(tiles, num_keys, DEVICE)
            assert 1 <= splits <= MAX_SPLITS and split_len % BLOCK_N == 0
            assert (splits - 1) * split_len < num_keys <= splits * split_len  # none empty, all keys covered


@cpu_only
def test_wrapper_rejects_bad_inputs() -> None:
    case = make_case([10], [0], 16, 4, (4, 2), 16, torch.float16, None, seed=0)
    with pytest.raises(ValueError, match="int64"):
        draft_block_attention(**{**case, "positions": case["positions"].int()}, window=None, causal=False)
    with pytest.raises(ValueError, match="dtype"):
        draft_block_attention(**{**case, "q": case["q"].float()}, window=None, causal=False)
    with pytest.raises(ValueError, match="power of two"):
        draft_block_attention(**{**case, "q": case["q"][..., :12], "k": case["k"][..., :12],
                                 "v": case["v"][..., :12], "keys": case["keys"][..., :12],
                                 "values": case["values"][..., :12]}, window=None, causal=False)


QWEN3_8B = dict(capacity=1024, block=16, heads=(32, 8), head_dim=128, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("sessions", [1, 3, 64])
@pytest.mark.parametrize("window,causal,serving_window", [(None, False, 1008), (None, False, None), (700, True, 1008)])
def test_kernel_matches_the_torch_path_gpu(sessions: int, window: int | None, causal: bool,
                                           serving_window: int | None) -> None:
    """The 8B drafter's shape: 65 slots (64 sessions and the dump slot), sessions shorter and longer than
    the ring; with three sessions the third is the first's padding copy."""
    gen = torch.Generator().manual_seed(sessions)
    lengths = torch.randint(0, 3000, (65,), generator=gen).tolist()
    slots = torch.randperm(64, generator=gen)[:sessions].tolist()
    if sessions == 3:
        slots[2] = slots[0]
    check(make_case(lengths, slots, **QWEN3_8B, serving_window=serving_window, seed=sessions), window, causal)


@pytest.mark.gpu
def test_one_capture_replays_for_new_positions_gpu() -> None:
    """What DraftGraphs does: one capture, new slots, positions and queries written in place before each replay."""
    case = make_case([2000, 17, 900, 1500], [0, 1, 2, 3], **QWEN3_8B, serving_window=1008, seed=0)
    run = lambda: draft_block_attention(**case, window=None, causal=False)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step, lengths in enumerate([[2000, 17, 900, 1500], [5, 3000, 1024, 0], [1, 1, 4000, 1023]]):
        fresh = make_case(lengths, [3, 1, 0, 2], **QWEN3_8B, serving_window=1008, seed=step + 1)
        for name, tensor in case.items():
            tensor.copy_(fresh[name])
        graph.replay()
        atol, rtol = TOL[torch.bfloat16]
        torch.testing.assert_close(out.float(), torch_path(case, None, False), atol=atol, rtol=rtol)


def drafter(head_dim: int) -> DFlashModel:
    """A 3-layer drafter of random weights (large enough that a wrong key shows): sliding causal, full, sliding."""
    raw = {"architectures": ["DFlashDraftModel"], "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": head_dim,
           "num_target_layers": 8, "block_size": 16, "dflash_config": {"mask_token_id": 511},
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 40,
           "torch_dtype": "float32"}
    model = DFlashModel(DFlashConfig.from_hf(raw), vocab_size=512).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(head_dim)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def ring_contexts(model: DFlashModel, lengths: list[int], capacity: int) -> list[LayerContext]:
    """Each layer's slot buffers of sessions of `lengths` positions (random target features), as the mirrors
    keep them."""
    positions = ring_positions(lengths, capacity)
    slot, row = (positions >= 0).nonzero(as_tuple=True)
    features = torch.randn(len(slot), model.config.feature_dim, generator=torch.Generator().manual_seed(1))
    contexts = []
    for k, v in model.context_key_values(model.context_features(features), positions[slot, row]):
        shape = (len(lengths), capacity + model.config.block_size, *k.shape[1:])
        keys, values = k.new_zeros(shape), v.new_zeros(shape)
        keys[slot, row], values[slot, row] = k, v
        contexts.append(LayerContext(keys, values, positions.clone()))
    return contexts


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_draft_logits_on_cuda_match_the_torch_path(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole draft: fp32 on CUDA (the kernel) against the CPU (the torch path); bf16 on CUDA against the same
    model with the torch path swapped in for the kernel."""
    model, window = drafter(head_dim), 100
    lengths = [0, 50, 300, 117, 99]
    contexts = ring_contexts(model, lengths, window + model.config.block_size)
    slots, roots = torch.tensor([2, 0, 4, 3, 2]), torch.tensor([7, 100, 3, 510, 7])
    starts = torch.tensor(lengths)[slots]
    expected = model.draft_logits(roots, starts, slots, contexts, window)

    def on_cuda(dtype: torch.dtype) -> torch.Tensor:
        cuda_model = copy.deepcopy(model).to("cuda", dtype)
        cuda_model.rotary = copy.deepcopy(model.rotary).cuda()  # NOTE: fp32 frequencies, as load_dflash keeps them
        cuda_contexts = [LayerContext(c.keys.to("cuda", dtype), c.values.to("cuda", dtype), c.positions.cuda())
                         for c in contexts]
        return cuda_model.draft_logits(roots.cuda(), starts.cuda(), slots.cuda(), cuda_contexts, window).float()

    torch.testing.assert_close(on_cuda(torch.float32).cpu(), expected, atol=2e-3, rtol=2e-3)
    got = on_cuda(torch.bfloat16)
    monkeypatch.setattr(draft_attention, "draft_block_attention", lambda q, k, v, keys, values, positions, *args:
                        block_attention(q, k, v, LayerContext(keys, values, positions), *args))
    reference = on_cuda(torch.bfloat16)
    assert (got - reference).norm() / reference.norm() < 2e-2
