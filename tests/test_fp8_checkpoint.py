"""FP8 checkpoints with block scales (the DeepSeek-V3 / Kimi K2 format) load dequantized, tensor by tensor, into the
model dtype; other quantizations are refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from modeling.checkpoint import iter_tensors, load_causal_lm, save_sharded
from modeling.config import ModelConfig, read_config_json
from modeling.tiny import make_tiny_target
from tests.engine_helpers import CausalAttention

BLOCK = (16, 24)  # not square; partial at the bottom or right edge of most of the tiny weights
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
SHAPES = {"qwen3": {"intermediate_size": 88}, "deepseek_v3": {}}  # Qwen3's MLP: 88 rows, 5.5 blocks


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and one fp32 scale per block, the block's largest magnitude mapped to FP8's largest."""
    rows, cols = BLOCK
    scale_inv = torch.empty(math.ceil(weight.shape[0] / rows), math.ceil(weight.shape[1] / cols))
    fp8 = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i, j in blocks(scale_inv):
        tile = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
        scale_inv[i, j] = tile.abs().max() / torch.finfo(torch.float8_e4m3fn).max
        fp8[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (tile / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return fp8, scale_inv


def block_reference(fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The format's definition, block by block: weight.float() * that block's scale_inv."""
    rows, cols = BLOCK
    out = torch.empty(fp8.shape)
    for i, j in blocks(scale_inv):
        out[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (
            fp8[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].float() * scale_inv[i, j])
    return out


def blocks(scale_inv: torch.Tensor) -> list[tuple[int, int]]:
    return [(i, j) for i in range(scale_inv.shape[0]) for j in range(scale_inv.shape[1])]


def write_fp8_checkpoint(source: Path, dest: Path, quantization: dict | None) -> dict[str, tuple[torch.Tensor, ...]]:
    """A copy of `source` with every 2-D projection weight in FP8 (the MoE router stays as it is, as in DeepSeek's
    checkpoints) and `quantization` as its quantization_config. The scales are written after all the weights,
    so they land in another shard than most of their weights. Returns {name: (fp8, scale_inv)}."""
    dest.mkdir()
    raw = read_config_json(source)
    if quantization is not None:
        raw["quantization_config"] = quantization
    (dest / "config.json").write_text(json.dumps(raw))
    weights, scales, quantized = {}, {}, {}
    for name, tensor in iter_tensors(source):
        if name.endswith("_proj.weight"):
            quantized[name] = quantize(tensor)
            weights[name], scales[f"{name}_scale_inv"] = quantized[name]
        else:
            weights[name] = tensor
    tensors = {**weights, **scales}
    save_sharded(tensors, dest, max_shard_bytes=sum(t.numel() * t.element_size() for t in tensors.values()) // 2)
    return quantized


@pytest.fixture(params=sorted(SHAPES))
def checkpoints(request, tmp_path) -> tuple[Path, Path, dict[str, tuple[torch.Tensor, ...]]]:
    """(the unquantized tiny checkpoint, its FP8 copy, the FP8 copy's quantized tensors)."""
    source = make_tiny_target(tmp_path / "source", arch=request.param, shape=SHAPES[request.param])
    return source, tmp_path / "fp8", write_fp8_checkpoint(source, tmp_path / "fp8", FP8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_the_block_dequantization(checkpoints, dtype: torch.dtype) -> None:
    source, fp8_dir, quantized = checkpoints
    params = dict(load_causal_lm(fp8_dir, dtype=dtype).named_parameters())
    originals = dict(iter_tensors(source))
    assert len(quantized) > 10 and set(params) == set(originals)
    for name, param in params.items():
        if name in quantized:
            assert param.dtype == dtype and torch.equal(param, block_reference(*quantized[name]).to(dtype)), name
            assert (param.float() - originals[name]).norm() < 0.05 * originals[name].norm(), name
        else:  # norms, embeddings, the LM head, a MoE router (kept in fp32)
            assert torch.equal(param, originals[name].to(param.dtype)), name


def test_model_runs_close_to_the_unquantized_one(checkpoints) -> None:
    source, fp8_dir, _ = checkpoints
    ids, positions = torch.arange(24) + 40, torch.arange(24)
    logits = []
    for path in (source, fp8_dir):
        model = load_causal_lm(path, dtype="float32")
        with torch.no_grad():
            logits.append(model.logits(model(ids, positions, CausalAttention(ModelConfig.from_dir(path)))[0]))
    expected, got = logits
    assert got.isfinite().all() and (got - expected).norm() < 0.1 * expected.norm()


def test_a_tensor_parallel_part_dequantizes_only_its_slice(checkpoints) -> None:
    """Row and column parts that start inside a block read the matching scales; scales are never yielded."""
    _, fp8_dir, quantized = checkpoints
    name = next(name for name in quantized if "down_proj" in name)
    full = block_reference(*quantized[name])
    for index in [(slice(5, 37),), (slice(None), slice(7, 30)), (slice(17, 18), slice(23, 25))]:
        ((_, part),) = iter_tensors(fp8_dir, {name}, lambda _, index=index: index)
        assert torch.equal(part, full[index])
    yielded = dict(iter_tensors(fp8_dir))
    assert not any(name.endswith("_scale_inv") for name in yielded)
    assert torch.equal(yielded[name], full)


def test_fp8_weights_without_an_fp8_config_are_refused(tiny_target, tmp_path) -> None:
    write_fp8_checkpoint(tiny_target, tmp_path / "fp8", quantization=None)
    with pytest.raises(ValueError, match="without block scales"):
        load_causal_lm(tmp_path / "fp8")


def test_unknown_quant_method_is_named(tiny_target, tmp_path) -> None:
    write_fp8_checkpoint(tiny_target, tmp_path / "gptq", quantization={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="'gptq'"):
        load_causal_lm(tmp_path / "gptq")
