"""The DFlash drafter: checkpoint loading, and the cached session mirror against a plain recomputation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import modeling.dflash as dflash
from drafter_service.dflash_drafter import DFlashDrafter, SessionNotFound, StaleStep
from modeling.dflash import DFlashConfig, DFlashModel, default_target_layer_ids, load_dflash
from modeling.tiny import make_tiny_drafter

# name -> (config.json overrides, serving window W); the tiny drafter has 2 layers and block size 8.
VARIANTS = {
    "full": ({}, None),
    "full-W": ({}, 12),
    "sliding": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}, None),
    "sliding-W": ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 6}, 10),
    "sliding-noncausal": ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 4, "is_causal": False}, 9),
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, 16),
}


def drafter_dir(tmp_path: Path, target: Path, **overrides) -> Path:
    path = make_tiny_drafter(tmp_path / "drafter", target, seed=1)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **overrides}))
    return path


def sharpened(model: DFlashModel, seed: int = 0) -> DFlashModel:
    """Larger random weights than the checkpoint's (which give near-uniform attention and logits), so that a
    wrong position, mask or weight shows in the output."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def load(tmp_path: Path, target: Path, overrides: dict) -> DFlashModel:
    return sharpened(load_dflash(drafter_dir(tmp_path, target, **overrides), target, dtype="float32"))


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


@torch.no_grad()
def recompute(model: DFlashModel, features: torch.Tensor, root: int, window: int | None) -> torch.Tensor:
    """The drafter's math from scratch over the whole context (its last W tokens), no cache: [B-1, V]."""
    config, n, block = model.config, features.shape[0], model.config.block_size
    first = 0 if window is None else max(0, n - window)
    context = model.hidden_norm(model.fc(features[first:]))  # [n - first, H]
    query_pos, key_pos = torch.arange(n, n + block), torch.arange(first, n + block)
    cos_q, sin_q = model.rotary(query_pos, torch.float32)
    cos_k, sin_k = model.rotary(key_pos, torch.float32)
    distance = query_pos[:, None] - key_pos[None, :]  # [B, n - first + B]
    x = model.embed_tokens(torch.tensor([root] + [config.mask_token_id] * (block - 1)))
    for i, layer in enumerate(model.layers):
        visible = torch.ones_like(distance, dtype=torch.bool)
        if config.layer_types[i] == "sliding_attention":
            causal = config.is_causal is not False
            visible = (distance.abs() < config.sliding_window) & ((distance >= 0) | (not causal))
        h = layer.input_layernorm(x)
        q = layer.self_attn.query(h, cos_q, sin_q)
        k, v = layer.self_attn.key_value(torch.cat([context, h]), cos_k, sin_k)
        x = x + layer.self_attn.output(plain_attention(q, k, v, visible))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return torch.log_softmax(model.lm_head(model.norm(x[1:])), dim=-1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_steps_match_recomputing_from_scratch(variant: str, tmp_path, tiny_target) -> None:
    overrides, window = VARIANTS[variant]
    model = load(tmp_path, tiny_target, overrides)
    drafter = DFlashDrafter(model, context_window=window)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(13, model.config.feature_dim, generator=generator)
    drafter.open("s", features, start_position=0)
    # (committed tokens, rollback before them); a rollback of up to one block drafts exactly.
    for step, (count, rollback) in enumerate([(1, 0), (3, 0), (8, 0), (0, 0), (2, 5), (5, 0), (7, 8), (4, 1)]):
        if rollback:
            features = features[:-rollback]
            drafter.crop("s", features.shape[0])
        new = torch.randn(count, model.config.feature_dim, generator=generator)
        features = torch.cat([features, new])
        root = int(torch.randint(0, 256, (1,), generator=generator))
        got = drafter.step("s", new, root, step_number=step)
        torch.testing.assert_close(got, recompute(model, features, root, window), atol=1e-5, rtol=1e-5)


def test_reseeding_from_the_last_w_tokens_drafts_the_same(tmp_path, tiny_target) -> None:
    window = 10
    model = load(tmp_path, tiny_target, {"layer_types": ["sliding_attention"] * 2, "sliding_window": 7})
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(40, model.config.feature_dim, generator=generator)
    seen_all = DFlashDrafter(model, context_window=window)
    seen_all.open("s", features[:5], start_position=0)
    for start, stop in [(5, 9), (9, 22), (22, 31)]:
        seen_all.step("s", features[start:stop], 7)
    reseeded = DFlashDrafter(model, context_window=window)
    reseeded.open("s", features[31 - window:31], start_position=31 - window)
    for start, stop, root in [(31, 31, 3), (31, 34, 99), (34, 40, 250)]:
        expected = seen_all.step("s", features[start:stop], root)
        torch.testing.assert_close(reseeded.step("s", features[start:stop], root), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ["full", "sliding-W"])
def test_batched_draft_equals_per_session_drafts(variant: str, tmp_path, tiny_target) -> None:
    overrides, window = VARIANTS[variant]
    model = load(tmp_path, tiny_target, overrides)
    single, batched = DFlashDrafter(model, window), DFlashDrafter(model, window)
    generator = torch.Generator().manual_seed(3)
    sessions = {"a": 3, "b": 17, "c": 30}  # different context lengths
    for name, length in sessions.items():
        seed = torch.randn(length, model.config.feature_dim, generator=generator)
        single.open(name, seed, start_position=2)
        batched.open(name, seed, start_position=2)
    for counts in [(1, 4, 0), (8, 2, 5)]:
        requests = [(name, torch.randn(m, model.config.feature_dim, generator=generator), 40 + m)
                    for name, m in zip(sessions, counts)]
        expected = torch.stack([single.step(*request) for request in requests])
        torch.testing.assert_close(batched.draft_batch(requests), expected, atol=1e-5, rtol=1e-5)


def test_weights_load_with_and_without_the_model_prefix(tmp_path, tiny_target) -> None:
    plain = drafter_dir(tmp_path, tiny_target)
    prefixed = tmp_path / "prefixed"
    shutil.copytree(plain, prefixed)
    tensors = load_file(prefixed / "model.safetensors")
    save_file({f"model.{name}": t for name, t in tensors.items()}, prefixed / "model.safetensors")
    expected = load_dflash(plain, tiny_target, dtype="float32").state_dict()
    got = load_dflash(prefixed, tiny_target, dtype="float32").state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=0, rtol=0)
    torch.testing.assert_close(expected["fc.weight"], tensors["fc.weight"], atol=0, rtol=0)


def test_loader_reads_only_the_embedding_and_lm_head_from_the_target(tmp_path, tiny_target, monkeypatch) -> None:
    read: dict[Path, set[str]] = {}

    def spy(path, wanted=None):
        for name, tensor in original(path, wanted):
            read.setdefault(Path(path), set()).add(name)
            yield name, tensor

    original = dflash.iter_tensors
    monkeypatch.setattr(dflash, "iter_tensors", spy)
    model = load_dflash(drafter_dir(tmp_path, tiny_target), tiny_target, dtype="float32")
    assert read[Path(tiny_target)] == {"model.embed_tokens.weight", "lm_head.weight"}
    (_, head), = original(tiny_target, {"lm_head.weight"})
    torch.testing.assert_close(model.lm_head.weight, head, atol=0, rtol=0)


def test_tied_target_embedding_serves_as_lm_head(tmp_path, tiny_target) -> None:
    """A target directory holding nothing but the (tied) embedding is enough for the drafter."""
    stripped = tmp_path / "stripped-target"
    stripped.mkdir()
    raw = json.loads((Path(tiny_target) / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    embedding = torch.randn(raw["vocab_size"], raw["hidden_size"])
    save_file({"model.embed_tokens.weight": embedding}, stripped / "model.safetensors")
    model = load_dflash(drafter_dir(tmp_path, tiny_target), stripped, dtype="float32")
    assert model.lm_head.weight is model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, embedding, atol=0, rtol=0)


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B-DFlash-b16's published ids
    assert default_target_layer_ids(28, 5) == (1, 7, 13, 19, 25)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(40, 3) == tuple(round(1 + i * 36 / 2) for i in range(3)) == (1, 19, 37)
    raw = {"architectures": ["DFlashDraftModel"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 5, "num_attention_heads": 2, "num_target_layers": 36, "block_size": 16,
           "dflash_config": {"mask_token_id": 7}}
    config = DFlashConfig.from_hf(raw)
    assert config.target_layer_ids == (1, 9, 17, 25, 33)
    assert config.feature_dim == 5 * 8 and config.layer_types == ("full_attention",) * 5


def test_the_tiny_drafter_matches_the_tiny_target(tmp_path, tiny_target) -> None:
    config = DFlashConfig.from_dir(make_tiny_drafter(tmp_path / "d", tiny_target, seed=1))
    assert config.mask_token_id == 259 and config.block_size in (8, 16)
    assert all(0 <= i < 4 for i in config.target_layer_ids)


def test_stale_steps_and_unknown_sessions_change_nothing(tmp_path, tiny_target) -> None:
    model = load(tmp_path, tiny_target, {})
    drafter = DFlashDrafter(model)
    features = torch.randn(6, model.config.feature_dim)
    drafter.open("s", features[:4], start_position=0)
    expected = drafter.step("s", features[4:], 9, step_number=3)
    with pytest.raises(StaleStep):
        drafter.step("s", features[4:], 9, step_number=3)
    with pytest.raises(SessionNotFound):
        drafter.draft_batch([("s", features[:0], 9, 4), ("gone", features[:0], 9, 1)])
    torch.testing.assert_close(drafter.step("s", features[:0], 9, step_number=4), expected)  # n is still 6
    drafter.close("s")
    with pytest.raises(SessionNotFound):
        drafter.step("s", features[:0], 9)
    with pytest.raises(ValueError, match="block size"):
        DFlashDrafter(model, context_window=4)
