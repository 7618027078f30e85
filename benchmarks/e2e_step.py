"""One decode step of a target (random bf16 weights) on one GPU, side by side:

- this engine: the verify step alone (forward + greedy head, replayed from a CUDA graph, and eagerly),
  the whole engine step (batch upload, verify, target tokens, acceptance, commit), and draft + tree + step
  with a 5-layer DFlash-shaped drafter, as served (the verify keeps the drafter's target-layer features and the
  next draft commits the step's committed rows); for the breakdown, the attention kernel alone x layers;
- the DDTree reference way: HF transformers' model of the same shape (its own random weights: timing does not
  depend on the values, and an MoE model does not fit twice), SDPA with a dense 4-D additive mask over
  prefix + tree, DynamicCache cropped back after the step; skipped above `--hf-max-context`; with `--hf-layers`
  timed on models of fewer layers and extrapolated (a long context's whole HF cache does not fit);
- the roofline floor: max(weight + KV bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured here;
  for an MoE target the weights are those a step touches (every expert some token of the block routes to).

Shapes: Qwen3-8B (the default), GLM-4.7-Flash and DeepSeek-V2-Lite (MLA + MoE). The KV prefix holds random
values; no prefill is run.

    python benchmarks/e2e_step.py [--shape qwen3-8b|glm-4.7-flash|deepseek-v2-lite] [--contexts 1024 ...]
        [--budgets 15 63] [--hf-max-context N] [--hf-layers FEW MORE] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from drafter_service.dflash_drafter import DFlashDrafter
from modeling.config import ModelConfig
from modeling.dflash import DFlashConfig, DFlashModel
from modeling.speculation import DrafterSeed, DraftStep
from modeling.target import CausalLM
from modeling.tiny import QWEN3_06B_SHAPE
from modeling.tree import DraftTree
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import Engine, StepResult
from verifier_service.engine.kv_cache import KVCache
from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.verify_batch import BlockSpec, build_verify_batch

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# MLA + MoE targets as published (transformers' config defaults for GLM-4.7-Flash; DeepSeek-V2-Lite's config)
GLM_47_FLASH = {"architectures": ["Glm4MoeLiteForCausalLM"], "torch_dtype": "bfloat16", "model_type": "glm4_moe_lite"}
DEEPSEEK_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
                    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                    "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "max_position_embeddings": 163840, "rope_theta": 10000.0,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def dflash_shape(target: dict, layer_ids: list[int], heads: int, kv_heads: int, head_dim: int,
                 intermediate: int) -> dict:
    """A 5-layer, block-16 DFlash drafter shaped like the published ones for this target's hidden size."""
    return {"architectures": ["DFlashDraftModel"], "vocab_size": target["vocab_size"],
            "hidden_size": target["hidden_size"], "intermediate_size": intermediate, "num_hidden_layers": 5,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "block_size": 16, "num_target_layers": target["num_hidden_layers"],
            "dflash_config": {"mask_token_id": target["vocab_size"] - 1, "target_layer_ids": layer_ids},
            "layer_types": ["full_attention"] * 5}


TINY = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY_MLA = {**DEEPSEEK_V2_LITE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
            "n_routed_experts": 8, "num_experts_per_tok": 2}
QWEN3_06B = {**QWEN3_8B, **QWEN3_06B_SHAPE, "vocab_size": 320}  # as throughput.py's random model (byte vocab)
SHAPE_NAMES = ("qwen3-8b", "qwen3-0.6b", "glm-4.7-flash", "deepseek-v2-lite", "tiny", "tiny-mla")


def shape_of(name: str) -> tuple[dict, dict, str]:
    """(target config, drafter config, device) of a shape; the tiny ones are smoke tests of this script."""
    if name == "qwen3-8b":
        return QWEN3_8B, dflash_shape(QWEN3_8B, [1, 9, 17, 25, 33], 32, 8, 128, 12288), "cuda"
    if name == "qwen3-0.6b":
        return QWEN3_06B, dflash_shape(QWEN3_06B, [1, 7, 13, 19, 25], 16, 8, 128, 3072), "cuda"
    if name == "glm-4.7-flash":
        import transformers

        target = {**transformers.Glm4MoeLiteConfig().to_dict(), **GLM_47_FLASH}
        return target, dflash_shape(target, [1, 12, 23, 34, 45], 16, 4, 128, 6144), "cuda"
    if name == "deepseek-v2-lite":
        return DEEPSEEK_V2_LITE, dflash_shape(DEEPSEEK_V2_LITE, [1, 7, 13, 19, 25], 16, 4, 128, 6144), "cuda"
    if name == "tiny":
        return TINY, dflash_shape(TINY, [1, 2, 3, 4, 5], 4, 2, 16, 128), "cpu"
    return TINY_MLA, dflash_shape(TINY_MLA, [0, 1, 2, 3], 4, 2, 16, 128), "cpu"


WINDOW = 1024


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 10, warmup: int = 3) -> float:
    """Mean wall time in ms of fn() with the GPU synchronised around it (what a step costs end to end)."""
    for _ in range(warmup):
        fn()
    synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize()
    return (time.perf_counter() - started) / reps * 1e3


def copy_bandwidth(device: str) -> float:
    src = torch.empty(2 << 30 if device == "cuda" else 1 << 24, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / (ms / 1e3)  # read + write


def matmul_rate(device: str) -> float:
    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = timed(lambda: a @ b, reps=20)
    return 2 * n**3 / (ms / 1e3)


def random_tree(budget: int, vocab: int, generator: torch.Generator) -> DraftTree:
    """A DDTree-like shape: a best-first tree of `budget` nodes over random per-depth scores."""
    from drafter_service.tree_builder import build_ddtree

    return build_ddtree(torch.randn(15, vocab, generator=generator).log_softmax(-1), budget)


def build_ours(shape: dict, drafter_shape: dict, device: str) -> tuple[CausalLM, DFlashModel]:
    """Our target with random weights on the device (normal(0, 0.02), norms 1), and the drafter sharing its
    embedding and LM head."""
    config = ModelConfig.from_hf(shape)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        ours = CausalLM(config).eval()
        drafter = DFlashModel(DFlashConfig.from_hf(drafter_shape), config.vocab_size).eval()
    torch.set_default_dtype(torch.float32)
    for name, param in [*ours.named_parameters(), *drafter.named_parameters()]:
        param.requires_grad_(False)
        param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(std=0.02)
    for module in ours.modules():
        if getattr(module, "keep_fp32", False):  # NOTE: as the loader keeps them (an MoE router), not bf16
            module.float()
    drafter.embed_tokens, drafter.lm_head = ours.model.embed_tokens, ours.lm_head
    return ours, drafter


def build_hf(shape: dict, device: str):
    """transformers' model of the same shape, randomly initialised by transformers on the device."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(shape["model_type"] if "model_type" in shape else "qwen3",
                                                  **{k: v for k, v in shape.items() if k != "model_type"})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    torch.set_default_dtype(torch.float32)
    return hf.requires_grad_(False)


def with_layers(shape: dict, layers: int) -> dict:
    """The shape cut to its first `layers` decoder layers (per-layer lists, such as which layers are sparse, cut
    too)."""
    total = shape["num_hidden_layers"]
    return {**{key: value[:layers] if isinstance(value, list) and len(value) == total else value
               for key, value in shape.items()}, "num_hidden_layers": layers}


def our_session(engine: Engine, context: int) -> str:
    """A session whose pages hold `context` positions (random K/V: the pool is filled at start)."""
    session, _ = engine.create_session([1, 2])
    session.block_table.prepare_write(1, context, engine.kv)
    session.tokens = [7] * (context + 1)
    return session.session_id


@torch.inference_mode()
def cache_layout(hf) -> list[tuple[torch.Size, torch.Size]]:
    """Each layer's cached key and value shapes for one token, as this transformers version lays them out (an MLA
    model may cache decompressed per-head K/V, or the per-head nope keys and the shared RoPE key)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    hf(input_ids=torch.tensor([[7]], device=hf.device), past_key_values=cache, use_cache=True)
    if hasattr(cache, "layers"):
        return [(layer.keys.shape, layer.values.shape) for layer in cache.layers]
    return [(k.shape, v.shape) for k, v in zip(cache.key_cache, cache.value_cache)]  # transformers < 4.56


def hf_step_fn(hf, context: int, tree: DraftTree):
    from transformers import DynamicCache

    device = hf.device
    cache = DynamicCache()
    for layer, (key_shape, value_shape) in enumerate(cache_layout(hf)):
        cache.update(torch.randn(*key_shape[:2], context, key_shape[3], dtype=torch.bfloat16, device=device),
                     torch.randn(*value_shape[:2], context, value_shape[3], dtype=torch.bfloat16, device=device),
                     layer)
    ids = torch.tensor([[7, *tree.tokens]], device=device)
    positions = torch.tensor([[context, *(context + d for d in tree.depths)]], device=device)
    parents = [-1, *(p + 1 for p in tree.parents)]
    visible = torch.zeros(len(parents), context + len(parents), dtype=torch.bool, device=device)
    visible[:, :context] = True
    for row, parent in enumerate(parents):
        visible[row, context + row] = True
        if parent >= 0:
            visible[row, context:] |= visible[parent, context:]
    mask = torch.zeros(visible.shape, dtype=torch.bfloat16, device=device)
    mask.masked_fill_(~visible, torch.finfo(torch.bfloat16).min)
    mask = mask[None, None]

    @torch.inference_mode()
    def step() -> None:
        out = hf(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
        out.logits.argmax(-1).tolist()
        cache.crop(-ids.shape[1])  # NOTE: a negative crop means "drop the last k" in old and new transformers
    return step, cache


def attention_alone(engine: Engine, block: BlockSpec) -> float:
    """One layer's verify attention (the engine's kernel, graph bound as in a captured step), in ms."""
    if engine.device.type != "cuda":
        return float("nan")
    import triton.testing

    batch = build_verify_batch([block], engine.device)
    batch = dataclasses.replace(batch, max_prefix_len=engine.max_context)
    config, rows, dtype = engine.model_config, batch.num_tokens, engine.kv.k.dtype
    if config.mla is not None:
        q = torch.randn(rows, config.num_heads, config.mla.latent_dim, dtype=dtype, device=engine.device)
        run = lambda: engine.backend.verify_latent(q, engine.kv.k[0], engine.scratch.k[0, :rows, 0], batch,
                                                   engine.sm_scale, engine.value_dim)
    else:
        q = torch.randn(rows, config.num_heads, config.head_dim, dtype=dtype, device=engine.device)
        tree_k, tree_v = engine.scratch.k[0, :rows], engine.scratch.v[0, :rows]
        run = lambda: engine.backend.verify(q, engine.kv.k[0], engine.kv.v[0], tree_k, tree_v, batch,
                                            engine.sm_scale)
    return triton.testing.do_bench_cudagraph(run, return_mode="median")


# PyTorch's generic CUDA kernels: what they run is a functor or kernel function named in their template arguments
_TORCH_WRAPPERS = {"vectorized_elementwise_kernel", "unrolled_elementwise_kernel", "elementwise_kernel",
                   "reduce_kernel", "index_elementwise_kernel", "BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor"}
_TORCH_KERNEL = re.compile(r"^(?:void )?(?:(?:\w+|\(anonymous namespace\))::)*(\w+)")
_TORCH_OP = re.compile(r"\b(\w+(?:_kernel_cuda|_kernel|Functor\w*|Ops))\b")


def kernel_group(name: str) -> str:
    """A readable bucket for a kernel name: cuBLAS GEMMs under one name, Triton kernels (named after their
    Python function, `_..._kernel`) by their own, PyTorch's by their kernel and, for its generic elementwise,
    reduce and index kernels, the operation they run (`vectorized_elementwise_kernel: silu_kernel`)."""
    if name.startswith("_"):
        return name.split("(")[0]
    if any(tag in name for tag in ("gemm", "nvjet", "cutlass", "xmma")):
        return "GEMM (cuBLAS)"
    if "::" not in name:  # NOTE: copies and sets: "Memcpy HtoD (Pinned -> Device)"
        return name.split("(")[0].strip()
    kernel = _TORCH_KERNEL.match(name).group(1)
    if kernel not in _TORCH_WRAPPERS:
        return kernel
    operation = next((op for op in _TORCH_OP.findall(name) if op not in _TORCH_WRAPPERS), None)
    return f"{kernel}: {operation}" if operation else kernel


def cuda_events(fn, steps: int = 5) -> list:
    """The GPU kernel events of `steps` calls of fn() (after one unprofiled call), CUDA-graph replays included."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        synchronize()
    return [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def kernel_breakdown(fn, steps: int = 5) -> dict[str, float]:
    """GPU time per step of each kernel group fn() launches, in ms."""
    totals: dict[str, float] = {}
    for event in cuda_events(fn, steps):
        group = kernel_group(event.name)
        totals[group] = totals.get(group, 0.0) + event.time_range.elapsed_us() / 1e3 / steps
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def step_tree(engine_config: ModelConfig, context: int, budget: int) -> DraftTree:
    """The same draft tree for our step and the HF step of one row."""
    return random_tree(budget, engine_config.vocab_size, torch.Generator().manual_seed(context + budget))


def measure_ours(engine: Engine, drafter: DFlashDrafter, context: int, budget: int) -> dict:
    config = engine.model_config
    tree = step_tree(config, context, budget)
    session_id = our_session(engine, context)
    engine.start_generation(session_id, SamplingParams(max_new_tokens=1 << 20, ignore_eos=True))
    session = engine.session(session_id)

    session.block_table.prepare_write(session.kv_len, session.kv_len + tree.max_depth() + 1, engine.kv)
    block = BlockSpec.from_tree(session.kv_len, session.root, tree, session.block_table.pages)

    @torch.inference_mode()
    def verify_only() -> None:
        hidden, _ = engine.forward([block])
        engine.head(hidden, greedy=True).tolist()

    @torch.inference_mode()
    def verify_eager() -> None:
        hidden, _ = engine._forward(build_verify_batch([block], engine.device))
        engine.head(hidden, greedy=True).tolist()

    def engine_step() -> None:
        engine.step([(session_id, tree)])

    feature_dim = drafter.info.feature_dim
    seed_features = torch.randn(WINDOW, feature_dim, dtype=torch.bfloat16, device=engine.device)
    drafter.open(session_id, DrafterSeed([7] * WINDOW, seed_features, session.kv_len - WINDOW))
    step_number = iter(range(1 << 30))
    # NOTE: as served, each step's verify keeps the drafter's target-layer features and the drafter commits the
    # rows the step committed; the first step commits the root with random features
    last = StepResult(session_id, accepted=[], path=[], emitted=[], commit_start=session.kv_len,
                      committed=[session.root], features=seed_features[-1:], finished=None)

    def whole_step() -> None:
        nonlocal last
        (drafted,) = drafter.draft([DraftStep(session_id, next(step_number), last.committed, last.features,
                                              session.root, drafter.mirrors.context_length(session_id), budget)])
        (last,) = engine.step([(session_id, drafted)])

    row = {"context": context, "budget": budget, "verify_ms": timed(verify_only),
           "verify_eager_ms": timed(verify_eager),
           "attention_ms": attention_alone(engine, block) * config.num_layers,
           "engine_step_ms": timed(engine_step)}
    profiled = engine.device.type == "cuda"
    if profiled:
        row["verify_kernels_ms"] = kernel_breakdown(verify_only)
        row["engine_step_busy_ms"] = sum(kernel_breakdown(engine_step).values())
    unserved, engine.feature_layers = engine.feature_layers, tuple(drafter.info.target_layer_ids)
    try:
        row["draft_and_step_ms"] = timed(whole_step)
        if profiled:
            row["draft_and_step_busy_ms"] = sum(kernel_breakdown(whole_step).values())
    except Exception as error:  # NOTE: keep the verify numbers when the drafter fails; the table says why
        row["draft_and_step_ms"], row["draft_error"] = float("nan"), repr(error)
    finally:
        engine.feature_layers = unserved
    drafter.close(session_id)
    engine.release_session(session_id)
    return row


def measure_hf(hf, config: ModelConfig, row: dict) -> None:
    """Adds the HF reference step of the row's context and tree (and its ratio to ours)."""
    hf_step, cache = hf_step_fn(hf, row["context"], step_tree(config, row["context"], row["budget"]))
    row["hf_reference_ms"] = timed(hf_step, reps=5, warmup=2)
    row["hf_vs_verify"] = row["hf_reference_ms"] / row["verify_ms"]
    del cache
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_hf_by_layers(shape: dict, device: str, config: ModelConfig, rows: list[dict], few: int,
                         more: int) -> None:
    """The HF reference step of each row, extrapolated from HF models of the shape's first `few` and `more` decoder
    layers: a layer costs their difference over `more - few`, and the rest of the step (embedding, head, the dense
    first layers' difference from a sparse one) what the `few`-layer step leaves. For contexts whose whole HF cache
    does not fit the GPU (GLM-4.7-Flash caches per-head K and V: ~20 KB per token and layer, 126 GB at 128k)."""
    for layers in (few, more):
        hf = build_hf(with_layers(shape, layers), device)
        for row in rows:
            measure_hf(hf, config, row)
            row.setdefault("hf_layers_ms", {})[layers] = row.pop("hf_reference_ms")
            print(json.dumps({"context": row["context"], "budget": row["budget"], "hf_layers": layers,
                              "hf_ms": row["hf_layers_ms"][layers]}), flush=True)
        del hf
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in rows:
        per_layer = (row["hf_layers_ms"][more] - row["hf_layers_ms"][few]) / (more - few)
        row["hf_reference_ms"] = row["hf_layers_ms"][few] + (config.num_layers - few) * per_layer
        row["hf_vs_verify"] = row["hf_reference_ms"] / row["verify_ms"]


def weight_counts(model: CausalLM) -> dict:
    """Parameters split into the routed experts (read only where a token routes) and the rest."""
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    return {"all": sum(p.numel() for p in model.parameters()), "routed": routed,
            "matmul": sum(p.numel() for name, p in model.named_parameters()
                          if "embed" not in name and "norm" not in name and ".mlp.experts." not in name)}


def step_work(config: ModelConfig, weights: dict, context: int, budget: int) -> dict:
    """Bytes and FLOPs of one verify step, split into the weights' part and attention's. Bytes: the weights (for
    MoE, the expected share of routed experts that the block's tokens touch under uniform routing) and the KV
    prefix; FLOPs: the weights each token uses (k routed experts) and attention (absorbed MLA: 576 + 512 per row
    and key)."""
    tokens = budget + 1
    routed_used = weights["routed"]
    routed_per_token = 0.0
    if config.moe is not None:
        experts, k = config.moe.num_experts, config.moe.experts_per_token
        routed_used = weights["routed"] * (1 - (1 - k / experts) ** tokens)
        routed_per_token = weights["routed"] * k / experts
    if config.mla is not None:
        kv_bytes = context * config.num_layers * config.mla.latent_dim * 2
        attention_flops = 2 * context * tokens * config.num_heads * (config.mla.latent_dim + config.mla.kv_lora_rank)
    else:
        kv_bytes = 2 * context * config.num_layers * config.num_kv_heads * config.head_dim * 2
        attention_flops = 4 * context * tokens * config.num_heads * config.head_dim
    return {"weight_bytes": 2 * (weights["all"] - weights["routed"] + routed_used),
            "weight_flops": 2 * tokens * (weights["matmul"] + routed_per_token),
            "kv_bytes": kv_bytes, "attention_flops": attention_flops * config.num_layers}


def roofline_ms(work: dict, floor: dict) -> float:
    """max(bytes / bandwidth, FLOPs / rate) over the whole step."""
    return 1e3 * max((work["weight_bytes"] + work["kv_bytes"]) / floor["bandwidth"],
                     (work["weight_flops"] + work["attention_flops"]) / floor["rate"])


def serial_floor_ms(work: dict, floor: dict) -> float:
    """The roofline taken per part and summed: the weights' max(bytes, FLOPs) plus attention's. Layers run one
    after another, so where attention is compute-bound and the weights bandwidth-bound (MLA at long context) no
    kernel order overlaps the two, and this is the floor a step can reach; the roofline above assumes they do."""
    return 1e3 * (max(work["weight_bytes"] / floor["bandwidth"], work["weight_flops"] / floor["rate"])
                  + max(work["kv_bytes"] / floor["bandwidth"], work["attention_flops"] / floor["rate"]))


def markdown(result: dict) -> str:
    lines = [f"# End-to-end decode step, {result.get('shape', 'qwen3-8b')} shape, bf16, {result['device']}", "",
             f"`{result['command']}`", "",
             f"copy bandwidth {result['bandwidth'] / 1e12:.2f} TB/s, bf16 matmul {result['rate'] / 1e12:.0f} TFLOP/s.",
             "verify = forward replayed from a CUDA graph + greedy head + reading the tokens; eager = the same "
             "forward launched op by op; attention = the verify kernel alone x layers (its share of verify); "
             "draft + tree + step = the DFlash drafter's commit and draft, its tree and the engine step, as served "
             "(the verify keeps the drafter's features, the next draft commits the step's rows).", "",
             "serial floor = the roofline per part (weights, attention) summed: where attention is compute-bound and "
             "the weights bandwidth-bound, the floor of layers that run one after another.", "",
             "| context | budget | roofline | serial floor | verify | verify / roofline | verify / serial floor "
             "| eager verify | attention | engine step | draft + tree + step | HF reference | HF / verify |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['context'] // 1024}k | {r['budget']} | {r['roofline_ms']:.2f} | "
                     f"{r['serial_floor_ms']:.2f} | {r['verify_ms']:.2f} | {r['verify_vs_roofline']:.2f}x | "
                     f"{r['verify_ms'] / r['serial_floor_ms']:.2f}x | {r['verify_eager_ms']:.2f} | "
                     f"{r['attention_ms']:.2f} | "
                     f"{r['engine_step_ms']:.2f} | {r['draft_and_step_ms']:.2f} | "
                     + (f"{'~' if 'hf_layers_ms' in r else ''}{r['hf_reference_ms']:.1f} | "
                        f"{r['hf_vs_verify']:.1f}x |" if "hf_reference_ms" in r else "- | - |"))
    lines += ["", "Times in ms, mean over repeated steps with the GPU synchronised per measurement.", ""]
    for r in result["rows"]:
        if "hf_layers_ms" in r:
            measured = ", ".join(f"{ms:.1f} ms with {layers} layers" for layers, ms in r["hf_layers_ms"].items())
            lines.append(f"~ HF reference at {r['context'] // 1024}k, budget {r['budget']}: extrapolated to the "
                         f"whole model from {measured} (`--hf-layers`).")
    for r in result["rows"]:
        if "engine_step_busy_ms" in r:  # NOTE: what the wall time holds beyond the GPU's work: host time it waits on
            lines.append(f"GPU busy (profiler) at {r['context'] // 1024}k, budget {r['budget']}: engine step "
                         f"{r['engine_step_busy_ms']:.2f} of {r['engine_step_ms']:.2f} ms, draft + tree + step "
                         f"{r.get('draft_and_step_busy_ms', float('nan')):.2f} of {r['draft_and_step_ms']:.2f} ms.")
    lines.append("")
    for r in result["rows"]:
        kernels = r.get("verify_kernels_ms")
        if kernels:
            busy = sum(kernels.values())
            lines += [f"Verify step at {r['context'] // 1024}k, budget {r['budget']}: GPU time per kernel "
                      f"(profiler, {busy:.2f} ms busy of {r['verify_ms']:.2f} ms)", "", "| kernel | ms |", "|---|---|"]
            lines += [f"| `{name}` | {ms:.3f} |" for name, ms in kernels.items()] + [""]
    return "\n".join(lines)


def engine_for(ours: CausalLM, device: str, max_context: int, sessions: int = 1) -> Engine:
    """An engine with pages for `sessions` sessions of `max_context` tokens, filled with random K/V."""
    config = ours.config
    page_bytes = KVCache.page_bytes(config, 64, torch.bfloat16)
    pages = sessions * (max_context // 64 + 2) + 8
    engine = Engine(ours, EngineConfig(page_size=64, kv_budget_bytes=pages * page_bytes,
                                       dtype="bfloat16", device=device,
                                       attention="triton" if device == "cuda" else "torch", max_context=max_context))
    for pages in (engine.kv.k, engine.kv.v):
        if pages is not None:
            pages.normal_()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPE_NAMES, default="qwen3-8b",
                        help="tiny / tiny-mla: small shapes on the CPU (smoke tests of this script)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 65536, 131072])
    parser.add_argument("--budgets", type=int, nargs="+", default=[15, 63])
    parser.add_argument("--hf-max-context", type=int, default=1 << 30,
                        help="skip the HF reference above this context (its cache holds per-head K/V)")
    parser.add_argument("--hf-layers", type=int, nargs=2, metavar=("FEW", "MORE"),
                        help="time the HF reference with only its first FEW and MORE decoder layers and extrapolate "
                             "its step to the whole model linearly (where its whole cache does not fit the GPU)")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if args.hf_layers and not 0 < args.hf_layers[0] < args.hf_layers[1]:
        parser.error(f"--hf-layers: FEW and MORE must satisfy 0 < FEW < MORE, got {args.hf_layers}")
    torch.manual_seed(0)
    shape, drafter_shape, device = shape_of(args.shape)
    ours, draft_model = build_ours(shape, drafter_shape, device)
    config, weights = ours.config, weight_counts(ours)
    engine = engine_for(ours, device, max(args.contexts) + 4096)
    drafter = DFlashDrafter(draft_model, WINDOW)
    floor = {"bandwidth": copy_bandwidth(device), "rate": matmul_rate(device)}
    rows = []
    for context in args.contexts:
        for budget in args.budgets:
            work = step_work(config, weights, context, budget)
            rows.append({**measure_ours(engine, drafter, context, budget),
                         "roofline_ms": roofline_ms(work, floor), "serial_floor_ms": serial_floor_ms(work, floor)})
            rows[-1]["verify_vs_roofline"] = rows[-1]["verify_ms"] / rows[-1]["roofline_ms"]
            print(json.dumps(rows[-1]), flush=True)
    del engine, drafter, ours, draft_model  # NOTE: an MoE target does not fit twice
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    hf_rows = [row for row in rows if row["context"] <= args.hf_max_context]
    if hf_rows and args.hf_layers:
        measure_hf_by_layers(shape, device, config, hf_rows, *args.hf_layers)
    elif hf_rows:  # NOTE: only then: GLM's HF model does not fit an H100 beside what our engine leaves allocated
        hf = build_hf(shape, device)
        for row in hf_rows:
            measure_hf(hf, config, row)
            print(json.dumps({k: row[k] for k in ("context", "budget", "hf_reference_ms")}), flush=True)
    device_name = "CPU" if device == "cpu" else torch.cuda.get_device_name()
    result = {"command": "python " + " ".join(sys.argv), "shape": args.shape, "device": device_name,
              "torch": torch.__version__, "bandwidth": floor["bandwidth"], "rate": floor["rate"], "rows": rows}
    write_results(args.out_dir, "e2e_step" if args.shape == "qwen3-8b" else f"e2e_step_{args.shape}", result,
                  markdown(result))


def titled_table(title: str, command: str, columns: list[str], rows: list[list[str]]) -> str:
    """A result file's markdown: its title, the command that made it, and one table."""
    lines = [f"# {title}", "", f"Command: `{command}`", "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def write_results(out_dir: Path, name: str, result: dict, table: str) -> None:
    """NAME.json and NAME.md (the table) in out_dir; the table is printed too."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{name}.md").write_text(table)
    print(table)


def git_commit() -> str | None:
    """HEAD's short hash, with '+dirty' when tracked files differ from it (the results a benchmark rewrites do not
    count); None outside a git checkout."""
    def git(*words: str) -> str:
        return subprocess.run(["git", "--no-optional-locks", *words], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no",
                                                                   "--", ".", ":!benchmarks/results")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


if __name__ == "__main__":
    main()
