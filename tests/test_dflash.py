"""The DFlash drafter: checkpoint loading, the slot-cached session mirror and the tree drafter against a plain
recomputation, and (on a GPU) CUDA-graph replays of the draft against the eager draft."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

import modeling.dflash as dflash
from drafter_service.dflash_drafter import DFlashDrafter
from drafter_service.dflash_mirrors import DFlashMirrors, RowBatch
from drafter_service.draft_graphs import DraftGraphs
from drafter_service.errors import SessionNotFound, StaleStep, TooManySessions
from drafter_service.tree_builder import build_ddtree
from modeling.dflash import DFlashConfig, DFlashModel, default_target_layer_ids, load_dflash
from modeling.speculation import DrafterSeed, DraftStep
from modeling.tiny import make_tiny_drafter
from modeling.tree import DraftTree

# name -> (config.json overrides, serving window W); the tiny drafter has 2 layers and block size 8.
VARIANTS = {
    "full": ({}, None),
    "full-W": ({}, 12),
    "sliding": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}, None),
    "sliding-W": ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 6}, 10),
    "sliding-noncausal": ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 4, "is_causal": False}, 9),
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, 16),
}


FRESH_STEPS = itertools.count(1000)  # step numbers above any a test names itself


def mirror_step(session_id: str, features: torch.Tensor, root: int, step: int | None = None) -> DraftStep:
    """A step as the mirrors read it: only the features, the root and the step number matter to them."""
    step = next(FRESH_STEPS) if step is None else step
    return DraftStep(session_id, step, [0] * features.shape[0], features, root, 0, 0)


def draft_one(mirrors: DFlashMirrors, *args) -> torch.Tensor:
    """One session's per-depth log-probs [B-1, V] (mirror_step's arguments)."""
    return mirrors.draft_batch([mirror_step(*args)])[0]


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


def load(tmp_path: Path, target: Path, overrides: dict, dtype: str = "float32", device: str = "cpu") -> DFlashModel:
    return sharpened(load_dflash(drafter_dir(tmp_path, target, **overrides), target, dtype=dtype, device=device))


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
    drafter = DFlashMirrors(model, context_window=window)
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
        got = draft_one(drafter, "s", new, root, step)
        torch.testing.assert_close(got, recompute(model, features, root, window), atol=1e-5, rtol=1e-5)


def test_reseeding_from_the_last_w_tokens_drafts_the_same(tmp_path, tiny_target) -> None:
    window = 10
    model = load(tmp_path, tiny_target, {"layer_types": ["sliding_attention"] * 2, "sliding_window": 7})
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(40, model.config.feature_dim, generator=generator)
    seen_all = DFlashMirrors(model, context_window=window)
    seen_all.open("s", features[:5], start_position=0)
    for start, stop in [(5, 9), (9, 22), (22, 31)]:
        draft_one(seen_all, "s", features[start:stop], 7)
    reseeded = DFlashMirrors(model, context_window=window)
    reseeded.open("s", features[31 - window:31], start_position=31 - window)
    for start, stop, root in [(31, 31, 3), (31, 34, 99), (34, 40, 250)]:
        expected = draft_one(seen_all, "s", features[start:stop], root)
        torch.testing.assert_close(draft_one(reseeded, "s", features[start:stop], root), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ["full", "sliding-W"])
def test_batched_draft_equals_per_session_drafts(variant: str, tmp_path, tiny_target) -> None:
    overrides, window = VARIANTS[variant]
    model = load(tmp_path, tiny_target, overrides)
    single, batched = DFlashMirrors(model, window), DFlashMirrors(model, window)
    generator = torch.Generator().manual_seed(3)
    sessions = {"a": 3, "b": 17, "c": 30}  # different context lengths
    for name, length in sessions.items():
        seed = torch.randn(length, model.config.feature_dim, generator=generator)
        single.open(name, seed, start_position=2)
        batched.open(name, seed, start_position=2)
    for counts in [(1, 4, 0), (8, 2, 5)]:
        requests = [(name, torch.randn(m, model.config.feature_dim, generator=generator), 40 + m)
                    for name, m in zip(sessions, counts)]
        expected = torch.stack([draft_one(single, *request) for request in requests])
        torch.testing.assert_close(batched.draft_batch([mirror_step(*r) for r in requests]), expected,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["full", "sliding-W"])
def test_fused_projections_draft_as_the_separate_ones(variant: str, tmp_path, tiny_target) -> None:
    """Every layer's context K/V as one GEMM (and each layer's Q/K/V, gate/up as one) drafts what the separate
    projections draft; a second fuse moves nothing."""
    overrides, window = VARIANTS[variant]
    separate = load(tmp_path, tiny_target, overrides)
    fused = copy.deepcopy(separate)
    fused.fuse_projections()
    weights = fused.context_kv
    fused.fuse_projections()
    assert fused.context_kv is weights
    generator = torch.Generator().manual_seed(3)
    features = [torch.randn(rows, separate.config.feature_dim, generator=generator) for rows in (7, 1, 3)]
    mirrors = [DFlashMirrors(model, window) for model in (separate, fused)]
    for m in mirrors:
        m.open("s", features[0], start_position=0)
    for step, rows in enumerate(features[1:]):
        expected, got = (m.draft_batch([mirror_step("s", rows, root=5 + step, step=step)]) for m in mirrors)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


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
    drafter = DFlashMirrors(model)
    features = torch.randn(6, model.config.feature_dim)
    drafter.open("s", features[:4], start_position=0)
    expected = draft_one(drafter, "s", features[4:], 9, 3)
    with pytest.raises(StaleStep):
        draft_one(drafter, "s", features[4:], 9, 3)
    with pytest.raises(SessionNotFound):
        drafter.draft_batch([mirror_step("s", features[:0], 9, 4), mirror_step("gone", features[:0], 9, 1)])
    torch.testing.assert_close(draft_one(drafter, "s", features[:0], 9, 4), expected)  # n is still 6
    drafter.close("s")
    with pytest.raises(SessionNotFound):
        draft_one(drafter, "s", features[:0], 9)
    with pytest.raises(ValueError, match="block size"):
        DFlashMirrors(model, context_window=4)


def assert_same_tree(got: DraftTree, expected: DraftTree) -> None:
    assert (got.tokens, got.parents, got.depths) == (expected.tokens, expected.parents, expected.depths)
    assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


@pytest.mark.parametrize("variant", ["full", "full-W", "sliding-W"])
def test_slot_trees_match_the_reference_as_sessions_come_and_go(variant: str, tmp_path, tiny_target) -> None:
    """Mixed lengths, rollbacks, a closed slot taken by a new session, a replaced mirror; without W the
    buffers grow (and move) as sessions do."""
    overrides, window = VARIANTS[variant]
    model = load(tmp_path, tiny_target, overrides)
    drafter = DFlashDrafter(model, window, max_budget=24, max_sessions=3)
    assert drafter.info.max_sessions == 3  # NOTE: what its Info tells verifiers (they seed only where there is room)
    generator = torch.Generator().manual_seed(4)
    feature_dim, history, step = model.config.feature_dim, {}, itertools.count()

    def open_session(name: str, length: int) -> None:
        history[name] = torch.randn(length, feature_dim, generator=generator)
        drafter.open(name, DrafterSeed([0] * length, history[name], 0))  # the mirror keeps what its layers can see

    def draft(plan: dict[str, tuple[int, int, int]]) -> None:
        """session -> (tokens committed, rolled back before them, budget)"""
        requests = []
        for name, (count, rollback, budget) in plan.items():
            kept = history[name][: history[name].shape[0] - rollback]
            new = torch.randn(count, feature_dim, generator=generator)
            history[name] = torch.cat([kept, new])
            root = int(torch.randint(0, 256, (1,), generator=generator))
            requests.append(DraftStep(name, next(step), [0] * count, new, root, kept.shape[0], budget))
        for request, tree in zip(requests, drafter.draft(requests)):
            logp = recompute(model, history[request.session_id], request.root, window)
            assert_same_tree(tree, build_ddtree(logp, min(request.budget, 24)))

    for name, length in [("a", 3), ("b", 20), ("c", 11)]:
        open_session(name, length)
    draft({"a": (1, 0, 24), "b": (4, 0, 5), "c": (0, 0, 100)})
    draft({"c": (2, 5, 24), "a": (8, 0, 9)})
    drafter.close("b")
    open_session("d", 30)  # into b's slot
    draft({"d": (2, 0, 24), "a": (3, 2, 24), "c": (9, 0, 1)})
    open_session("a", 6)  # replaces a's mirror in place
    draft({"a": (1, 0, 16), "d": (0, 7, 24), "c": (0, 0, 0)})
    assert drafter.mirrors.context_length("d") == 25


def test_open_past_max_sessions_raises_and_a_closed_slot_is_reused(tmp_path, tiny_target) -> None:
    window = 12
    model = load(tmp_path, tiny_target, {})
    drafter = DFlashMirrors(model, context_window=window, max_sessions=2)
    features = torch.randn(30, model.config.feature_dim, generator=torch.Generator().manual_seed(6))
    drafter.open("a", features[:20], start_position=0)
    drafter.open("b", features[:5], start_position=0)
    drafter.open("a", features[:25], start_position=0)  # replacing a mirror takes no new slot
    with pytest.raises(TooManySessions, match="2 sessions .*max_sessions"):
        drafter.open("c", features[:4], start_position=0)
    assert TooManySessions.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    drafter.close("a")
    drafter.open("c", features[:4], start_position=0)  # a's slot, which held a full ring: none of it may show
    assert drafter.commit([mirror_step("c", features[:0], 0)]).slots == [0]
    expected = recompute(model, features[:6], 17, window)
    torch.testing.assert_close(draft_one(drafter, "c", features[4:6], 17), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_sessions"):
        DFlashMirrors(model, context_window=window, max_sessions=0)


def test_rows_go_to_the_writer_unless_a_step_brings_more_than_a_layer_keeps(tmp_path, tiny_target) -> None:
    overrides, window = VARIANTS["sliding-W"]
    model = load(tmp_path, tiny_target, overrides)
    mirrors = DFlashMirrors(model, window, max_sessions=2)
    smallest = min(context.capacity for context in mirrors.contexts)
    written = []

    def writer(rows: RowBatch) -> None:
        written.append(rows)
        mirrors.write_now(rows)

    generator = torch.Generator().manual_seed(8)
    history = {name: torch.randn(length, model.config.feature_dim, generator=generator)
               for name, length in [("a", 5), ("b", 3)]}
    for name, features in history.items():
        mirrors.open(name, features, start_position=0)
    for counts in [{"a": 2, "b": 0}, {"b": smallest}, {"a": smallest + 1, "b": 1}]:
        steps = []
        for name, count in counts.items():
            new = torch.randn(count, model.config.feature_dim, generator=generator)
            history[name] = torch.cat([history[name], new])
            steps.append(mirror_step(name, new, 40 + count))
        mirrors.commit(steps, writer)
        for step in steps:
            expected = recompute(model, history[step.session_id], step.root, window)
            torch.testing.assert_close(draft_one(mirrors, step.session_id, step.features[:0], step.root), expected,
                                       atol=1e-5, rtol=1e-5)
    a, b = (mirrors.commit([mirror_step(name, history[name][:0], 0)]).slots[0] for name in "ab")
    assert [(rows.slots, rows.positions) for rows in written] == [
        ([a, a], [5, 6]), ([b] * smallest, list(range(3, 3 + smallest)))]  # the third step went the eager way
    assert mirrors.dump_slot == 2 and all(context.keys.shape[0] == 3 for context in mirrors.contexts)


def assert_same_top_k(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor],
                      everything: tuple[torch.Tensor, torch.Tensor], dtype: str) -> None:
    """got, expected: ranked top-k (values, ids) [S, D, K]; everything: the eager ranking of the whole vocab."""
    (values, ids), (expected_values, expected_ids) = got, expected
    if dtype == "float32":
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(values, expected_values, atol=1e-4, rtol=1e-4)
        return
    # bf16: near-equal log-probs may swap ranks; every token must still carry its own eager log-prob
    atol = 0.1
    torch.testing.assert_close(values, expected_values, atol=atol, rtol=0)
    logp = torch.empty_like(everything[0]).scatter_(-1, everything[1], everything[0])  # [S, D, V]
    torch.testing.assert_close(logp.gather(-1, ids), values, atol=atol, rtol=0)


def ranked(graphs: DraftGraphs, inputs, width: int) -> list[torch.Tensor]:
    """A draft's top-`width` rows, on the host."""
    return [rows.cpu() for rows in graphs.draft(inputs, width)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replays_match_the_eager_draft(dtype: str, tmp_path, tiny_target) -> None:
    """Every bucket (1, 2, 4, 8; padded batches of 3 and 5), before and after sessions change underneath."""
    overrides, window = VARIANTS["sliding-W"]
    model = load(tmp_path, tiny_target, overrides, dtype, "cuda")
    vocab = model.lm_head.weight.shape[0]
    mirrors = DFlashMirrors(model, window, max_sessions=8)
    graphed, eager = DraftGraphs(mirrors), DraftGraphs(mirrors, cuda_graphs=False)
    assert graphed.graphed and not eager.graphed
    generator = torch.Generator().manual_seed(5)

    def features(rows: int) -> torch.Tensor:
        return torch.randn(rows, model.config.feature_dim, generator=generator).to("cuda", getattr(torch, dtype))

    def check(names: list[str]) -> None:
        inputs = mirrors.commit([mirror_step(name, features(i % 4), 11 * i + 1) for i, name in enumerate(names)])
        everything = ranked(eager, inputs, vocab)
        for width in (16, 5):
            assert_same_top_k(ranked(graphed, inputs, width), ranked(eager, inputs, width), everything, dtype)

    names = [f"s{i}" for i in range(8)]
    for i, name in enumerate(names):
        mirrors.open(name, features(3 + 5 * i), start_position=i)
    for size in (1, 3, 2, 8, 5):
        check(names[size - 1::-1])
    assert sorted(graphed.captured) == [1, 2, 4, 8]
    mirrors.crop("s2", mirrors.context_length("s2") - 3)
    mirrors.close("s5")
    mirrors.open("new", features(40), start_position=0)  # s5's slot
    mirrors.open("s0", features(2), start_position=0)
    check(["new", "s0", "s2", "s7"])
    check(["s1", "new", "s3", "s4", "s0", "s6", "s7", "s2"])
    assert sorted(graphed.captured) == [1, 2, 4, 8]  # replays only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_commit_graphs_store_what_the_eager_commit_stores(dtype: str, tmp_path, tiny_target) -> None:
    """Every row bucket, commits larger than the largest (in chunks), host and device features, a step of more
    rows than a layer keeps (eager), a rollback and a reused slot; the captures at warm-up touch no session. The
    graphed commits run the fused projections and the context-rows kernel, the eager ones torch op by op."""
    overrides, window = VARIANTS["sliding-W"]
    model = load(tmp_path, tiny_target, overrides, dtype, "cuda")
    fused = copy.deepcopy(model)
    fused.fuse_projections()
    graphed, eager = DFlashMirrors(fused, window, max_sessions=4), DFlashMirrors(model, window, max_sessions=4)
    graphs = DraftGraphs(graphed)
    smallest = min(context.capacity for context in graphed.contexts)
    generator = torch.Generator().manual_seed(9)

    def features(rows: int, device: str = "cpu") -> torch.Tensor:
        return torch.randn(rows, model.config.feature_dim, generator=generator).to(device, getattr(torch, dtype))

    devices = itertools.cycle(["cpu", "cuda"])  # where the features come from (over gRPC: the host)

    def commit(plan: dict[str, int]) -> None:
        device = next(devices)
        new = {name: features(count, device) for name, count in plan.items()}
        graphed.commit([mirror_step(name, rows, 0) for name, rows in new.items()], graphs.write)
        eager.commit([mirror_step(name, rows, 0) for name, rows in new.items()])
        atol = 1e-5 if dtype == "float32" else 2e-2
        for mine, theirs in zip(graphed.contexts, eager.contexts):
            sessions = slice(0, graphed.dump_slot)
            assert torch.equal(mine.positions[sessions], theirs.positions[sessions])
            held = torch.nn.functional.pad(theirs.positions[sessions] >= 0, (0, model.config.block_size))
            torch.testing.assert_close(mine.keys[sessions][held], theirs.keys[sessions][held], atol=atol, rtol=0)
            torch.testing.assert_close(mine.values[sessions][held], theirs.values[sessions][held], atol=atol, rtol=0)

    for i, name in enumerate("abcd"):
        seed = features(3 + 4 * i)
        graphed.open(name, seed, start_position=0)
        eager.open(name, seed, start_position=0)
    graphs.warmup()
    assert sorted(graphs.committers) == graphs.row_buckets and graphs.row_buckets[-1] == 4 * model.config.block_size
    commit({"a": 0, "b": 0})
    commit({"a": 1, "b": 2, "c": 0, "d": 3})
    commit({name: smallest for name in "abcd"})  # more rows than the largest bucket
    commit({"b": smallest + 1, "c": 2})  # a step the smallest layer cannot hold at once: eager
    seed = features(9, "cuda")
    for mirrors in (graphed, eager):
        mirrors.crop("a", mirrors.context_length("a") - 3)
        mirrors.close("c")
        mirrors.open("e", seed, start_position=0)  # c's slot
    commit({"e": 5, "a": 4, "d": 1})
    assert sorted(graphs.committers) == graphs.row_buckets  # replays only


@pytest.mark.gpu
def test_the_tree_drafter_on_the_gpu_drafts_the_same_trees_from_graphs(tmp_path, tiny_target) -> None:
    overrides, window = VARIANTS["full-W"]
    model = load(tmp_path, tiny_target, overrides, "float32", "cuda")
    graphed = DFlashDrafter(model, window, max_budget=20, max_sessions=4)
    eager = DFlashDrafter(model, window, max_budget=20, max_sessions=4, cuda_graphs=False)
    on_cpu = DFlashDrafter(copy.deepcopy(model).cpu(), window, max_budget=20, max_sessions=4)
    graphed.warmup()
    assert sorted(graphed.graphs.captured) == [1, 2, 4] and not eager.graphs.captured
    rows = len(graphed.graphs.row_buckets)  # commit graphs: from one block to 4 sessions' blocks
    assert rows == 3 and (graphed.captured_graphs, eager.captured_graphs) == (3 + rows, 0)
    assert not DFlashDrafter(model, None).graphs.graphed  # no window: no fixed shapes to capture
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(60, model.config.feature_dim, generator=generator).cuda()
    for drafter in (graphed, eager, on_cpu):
        for i, name in enumerate("abc"):
            drafter.open(name, DrafterSeed([0] * (10 + 9 * i), features[: 10 + 9 * i], 0))
    for step, (names, count, budget) in enumerate([("abc", 1, 20), ("ca", 3, 7), ("b", 0, 20), ("abc", 2, 13)]):
        requests = []
        for name in names:
            length = graphed.mirrors.context_length(name)
            requests.append(DraftStep(name, step, [0] * count, features[length: length + count], 5 + step,
                                      length, budget))
        for got, expected, reference in zip(graphed.draft(requests), eager.draft(requests), on_cpu.draft(requests)):
            assert_same_tree(got, expected)
            assert_same_tree(got, reference)
