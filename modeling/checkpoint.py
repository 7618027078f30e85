"""Reading and writing Hugging Face safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddtree.progress import Progress
from modeling.config import ModelConfig, parse_dtype, read_config_json
from modeling.fp8 import FP8_DTYPES, SCALE_SUFFIX, BlockFP8
from modeling.rope import RotaryEmbedding
from modeling.target import CausalLM

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


TensorPart = Callable[[str], tuple[slice, ...] | None]  # name -> the index of the part to read; None = all


def iter_tensors(path: str | Path, wanted: set[str] | None = None,
                 part: TensorPart | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every shard; with `wanted`, only those names (others are never read); with
    `part`, only the indexed rows or columns of each (a tensor-parallel rank's slice; the rest is never read).
    Block-scaled FP8 weights (modeling/fp8.py) come dequantized to fp32 one at a time; their scales, read first
    (a 1/4096 of the FP8 bytes for 128 x 128 blocks), are never yielded."""
    fp8 = BlockFP8.from_config(read_config_json(path)) if (Path(path) / "config.json").is_file() else None

    def wants(name: str) -> bool:
        return wanted is None or name in wanted
    scales = {} if fp8 is None else dict(_read_tensors(
        path, lambda name: name.endswith(SCALE_SUFFIX) and wants(name.removesuffix(SCALE_SUFFIX)),
        task=f"loading FP8 scales from {Path(path).name}"))
    for name, tensor in _read_tensors(path, lambda name: wants(name) and name not in scales, part,
                                      task=f"loading weights from {Path(path).name}"):
        if tensor.dtype in FP8_DTYPES:
            if fp8 is None or name + SCALE_SUFFIX not in scales:
                raise ValueError(f"{name} is stored in {tensor.dtype} without block scales ({name}{SCALE_SUFFIX} "
                                 "and an fp8 quantization_config in config.json)")
            tensor = fp8.dequantize(tensor, scales[name + SCALE_SUFFIX], part(name) if part else None)
        yield name, tensor


def _read_tensors(path: str | Path, keep: Callable[[str], bool], part: TensorPart | None = None, *,
                  task: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The kept tensors, shard by shard, with the progress of `task`: the shard, and the bytes the kept tensors
    take in the checkpoint (a tensor counts whole once its `part` is read)."""
    files = checkpoint_files(path)
    kept = [{name: size for name, size in _stored_bytes(file).items() if keep(name)} for file in files]
    total = sum(sum(sizes.values()) for sizes in kept)
    with Progress(task, total, unit="B", detail=f"shard 1/{len(files)}") as progress:
        for number, (file, sizes) in enumerate(zip(files, kept), 1):
            progress.note(f"shard {number}/{len(files)}")
            with safe_open(str(file), framework="pt") as shard:
                for name in shard.keys():
                    if name in sizes:
                        index = part(name) if part else None
                        yield name, shard.get_tensor(name) if index is None else shard.get_slice(name)[index]
                        progress.advance(sizes[name])


def _stored_bytes(file: Path) -> dict[str, int]:
    """Each tensor's size in a safetensors file, from its header alone (a little-endian u64 length, then JSON)."""
    with open(file, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return {name: entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()
            if name != "__metadata__"}


def load_causal_lm(path: str | Path, dtype: str | torch.dtype | None = None,
                   device: str | torch.device = "cpu") -> CausalLM:
    """Build the model on the meta device and fill it from the checkpoint, shard by shard."""
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dir(path))
    return load_weights(model, path, dtype, device)


def load_weights(model: CausalLM, path: str | Path, dtype: str | torch.dtype | None = None,
                 device: str | torch.device = "cpu", part: TensorPart | None = None) -> CausalLM:
    """Fill a model built on the meta device from the checkpoint; `part` as in `iter_tensors`. Tensors the model
    does not hold are never read: rotary buffers some exporters write, DeepSeek-V3's multi-token-prediction layer
    (shipped as layer index num_hidden_layers)."""
    config = model.config
    dtype = parse_dtype(dtype or config.torch_dtype)
    model.to_empty(device=device)
    model.rotary = RotaryEmbedding(config.rope, config.head_dim).to(device)
    params = dict(model.named_parameters())
    fp32 = {f"{prefix}.{name}" for prefix, module in model.named_modules() if getattr(module, "keep_fp32", False)
            for name, _ in module.named_parameters(recurse=False)}  # e.g. MoE routers
    missing = set(params)
    for name, tensor in iter_tensors(path, set(params), part):
        if tensor.shape != params[name].shape:
            raise ValueError(f"{name}: the checkpoint gives {tuple(tensor.shape)}, the model holds "
                             f"{tuple(params[name].shape)}")
        params[name].data = tensor.to(device=device, dtype=torch.float32 if name in fp32 else dtype)
        missing.discard(name)
        if name == "model.embed_tokens.weight" and config.tie_word_embeddings:
            missing.discard("lm_head.weight")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors: {sorted(missing)[:5]} ...")
    return model.eval().requires_grad_(False)


def save_sharded(tensors: dict[str, torch.Tensor], path: str | Path, max_shard_bytes: int) -> None:
    """Write tensors as `model-0000i-of-0000n.safetensors` shards plus the HF index file."""
    path = Path(path)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
