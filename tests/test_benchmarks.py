"""The GPU benchmarks run rarely and on another machine: their CPU smoke modes run here, so a change that
breaks a benchmark script shows in CI rather than on the GPU host."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=300)


@pytest.mark.parametrize("shape", ["tiny", "tiny-mla"])
def test_e2e_step_smoke_run_writes_its_table(tmp_path: Path, shape: str) -> None:
    run_benchmark("e2e_step.py", "--shape", shape, "--contexts", "64", "--budgets", "7", "--out-dir", str(tmp_path))
    (row,) = json.loads((tmp_path / f"e2e_step_{shape}.json").read_text())["rows"]
    assert (row["context"], row["budget"]) == (64, 7)
    for key in ("verify_ms", "verify_eager_ms", "engine_step_ms", "draft_and_step_ms", "hf_reference_ms",
                "roofline_ms", "serial_floor_ms"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert "| 0k | 7 |" in (tmp_path / f"e2e_step_{shape}.md").read_text()


def test_e2e_step_serial_floor_counts_compute_bound_attention_beside_bandwidth_bound_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both parts bandwidth-bound: the two floors agree. Attention compute-bound while the weights are not: the
    whole-step roofline lets attention's FLOPs hide under the weights' bytes, the serial floor adds them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from e2e_step import roofline_ms, serial_floor_ms

    floor = {"bandwidth": 1e12, "rate": 1e14}  # 1 ms per GB, 1 ms per 100 GFLOP
    bandwidth_bound = {"weight_bytes": 4e9, "weight_flops": 1e11, "kv_bytes": 2e9, "attention_flops": 1e11}
    assert roofline_ms(bandwidth_bound, floor) == pytest.approx(6.0)
    assert serial_floor_ms(bandwidth_bound, floor) == pytest.approx(6.0)
    compute_bound_attention = {**bandwidth_bound, "attention_flops": 5e11}
    assert roofline_ms(compute_bound_attention, floor) == pytest.approx(6.0)
    assert serial_floor_ms(compute_bound_attention, floor) == pytest.approx(9.0)


def test_skinny_gemm_times_the_projections_of_the_shape_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.skinny_gemm import layer_gemms

    assert layer_gemms("qwen3-8b") == {"q/k/v": (6144, 4096, False), "o": (4096, 4096, False),
                                       "gate/up + SiLU": (24576, 4096, True), "down": (4096, 12288, False)}
    assert layer_gemms("qwen3-0.6b") == {"q/k/v": (4096, 1024, False), "o": (1024, 2048, False),
                                         "gate/up + SiLU": (6144, 1024, True), "down": (1024, 3072, False)}


def test_e2e_step_builds_no_hf_model_it_will_not_measure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every context past --hf-max-context the HF model is never built (GLM's does not fit an H100 beside
    what our engine leaves allocated)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import e2e_step

    monkeypatch.setattr(e2e_step, "build_hf", lambda *_: pytest.fail("built the HF model"))
    monkeypatch.setattr(sys, "argv", ["e2e_step.py", "--shape", "tiny", "--contexts", "64", "--budgets", "7",
                                      "--hf-max-context", "0", "--out-dir", str(tmp_path)])
    e2e_step.main()
    (row,) = json.loads((tmp_path / "e2e_step_tiny.json").read_text())["rows"]
    assert row["verify_ms"] > 0 and "hf_reference_ms" not in row


def test_e2e_step_extrapolates_the_hf_step_from_models_of_fewer_layers(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--hf-layers 1 3: HF models of the first 1 and 3 layers (per-layer lists cut alike); a step of 2 ms + 0.5 ms
    a layer is 4 ms for the 4-layer model, marked as extrapolated in the table."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import e2e_step

    built: list[dict] = []

    def build_hf(shape: dict, device: str) -> SimpleNamespace:
        built.append(shape)
        return SimpleNamespace(layers=shape["num_hidden_layers"])

    monkeypatch.setattr(e2e_step, "build_hf", build_hf)
    monkeypatch.setattr(e2e_step, "measure_hf", lambda hf, config, row: row.update(hf_reference_ms=2 + 0.5 * hf.layers))
    monkeypatch.setattr(sys, "argv", ["e2e_step.py", "--shape", "tiny-mla", "--contexts", "64", "--budgets", "7",
                                      "--hf-layers", "1", "3", "--out-dir", str(tmp_path)])
    e2e_step.main()
    assert [shape["num_hidden_layers"] for shape in built] == [1, 3]
    (row,) = json.loads((tmp_path / "e2e_step_tiny-mla.json").read_text())["rows"]
    assert row["hf_reference_ms"] == pytest.approx(4.0) and row["hf_layers_ms"] == {"1": 2.5, "3": 3.5}
    assert row["hf_vs_verify"] == pytest.approx(4.0 / row["verify_ms"])
    table = (tmp_path / "e2e_step_tiny-mla.md").read_text()
    assert "| ~4.0 |" in table and "extrapolated to the whole model from 2.5 ms with 1 layers" in table
    assert e2e_step.with_layers({"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"],
                                 "heads": [1, 2]}, 2) == {"num_hidden_layers": 2,
                                                          "mlp_layer_types": ["dense", "sparse"], "heads": [1, 2]}


def test_micro_batches_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("micro_batches.py", "--shape", "tiny", "--sessions", "4", "--context", "64", "--out-dir",
                  str(tmp_path))
    (row,) = json.loads((tmp_path / "micro_batches_tiny.json").read_text())["rows"]
    assert (row["sessions"], row["context"], row["streams"]) == (4, 64, 1)
    for key in ("whole_ms", "halves_in_turn_ms", "halves_beside_ms", "beside_vs_whole"):
        assert math.isfinite(row[key]) and row[key] > 0, key


def test_prefill_interference_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("prefill_interference.py", "--shape", "tiny", "--contexts", "700", "--decoders", "2",
                  "--decoder-tokens", "1024", "--baseline-s", "0.2", "--out-dir", str(tmp_path))
    (row,) = json.loads((tmp_path / "prefill_interference_tiny.json").read_text())["rows"]
    assert row["context"] == 700 and row["ttft_alone_ms"] > 0 and row["ttft_beside_ms"] > 0
    assert row["baseline_gap_ms"]["count"] > 0 and row["prefill_gap_ms"]["count"] > 0
    assert row["prefill_gap_ms"]["max"] >= row["prefill_gap_ms"]["p50"] > 0
    assert "| 700 |" in (tmp_path / "prefill_interference_tiny.md").read_text()


def test_draft_step_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("draft_step.py", "--shape", "tiny", "--sessions", "1", "3", "--committed", "2", "--profile",
                  "--out-dir", str(tmp_path))
    rows = json.loads((tmp_path / "draft_step_tiny.json").read_text())["rows"]
    assert [(r["sessions"], r["committed"], r["graphs"]) for r in rows] == [(1, 2, False), (3, 2, False)]
    for key in ("commit_ms", "draft_ms", "tree_ms", "whole_ms", "floor_ms"):
        assert all(math.isfinite(r[key]) and r[key] > 0 for r in rows), key
    text = (tmp_path / "draft_step_tiny.md").read_text()
    assert "| eager | 3 | 2 |" in text and "| draft + tree / floor |" in text
    # NOTE: --profile: each stage's ops, the drafter's matmuls among the draft's
    assert all(set(r["profile"]) == {"commit", "draft", "tree", "whole"} for r in rows)
    assert any("mm" in e["op"] for e in rows[1]["profile"]["draft"]["host"])
    assert "eager, 3 sessions, 2 committed, draft: ops by host time" in text


def test_batch_step_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("batch_step.py", "--shape", "tiny", "--sessions", "1", "3", "--budgets", "0", "7", "--context", "64",
                  "--burst", "4", "--out-dir", str(tmp_path))
    rows = json.loads((tmp_path / "batch_step_tiny.json").read_text())["rows"]
    assert [(r["sessions"], r["budget"], r["burst"]) for r in rows] == [(1, 0, 4), (3, 0, 4), (1, 7, 1), (3, 7, 1)]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in rows)
    assert "| 3 | 7 | 1 | 64 | greedy |" in (tmp_path / "batch_step_tiny.md").read_text()


def test_batch_step_samples_and_penalizes_when_asked(tmp_path: Path) -> None:
    run_benchmark("batch_step.py", "--shape", "tiny", "--sessions", "2", "--budgets", "0", "--context", "64",
                  "--temperature", "0.8", "--top-p", "0.9", "--frequency-penalty", "0.5", "--out-dir", str(tmp_path))
    (row,) = json.loads((tmp_path / "batch_step_tiny.json").read_text())["rows"]
    assert (row["temperature"], row["top_p"], row["frequency_penalty"]) == (0.8, 0.9, 0.5) and row["step_ms"] > 0
    assert "| 2 | 0 | 1 | 64 | T 0.8, top-p 0.9, frequency 0.5 |" in (tmp_path / "batch_step_tiny.md").read_text()


@pytest.mark.parametrize("shape", ["tiny", "tiny-mla"])
def test_prefill_smoke_run_writes_its_table(tmp_path: Path, shape: str) -> None:
    """Both prefill paths (chunks through the verify kernels, and longer ones: over 256 tokens for MLA) and HF."""
    run_benchmark("prefill.py", "--shape", shape, "--lengths", "600", "--chunks", "64", "300", "--hf-chunk", "256",
                  "--server-warm-up", "--out-dir", str(tmp_path))
    rows = json.loads((tmp_path / f"prefill_{shape}.json").read_text())["rows"]
    assert [(row["tokens"], row["chunk"]) for row in rows] == [(600, 64), (600, 300)]
    assert all(row["seconds"] > 0 and row["floor_s"] > 0 and row["hf_s"] > 0 for row in rows)
    assert "| 600 | 300 |" in (tmp_path / f"prefill_{shape}.md").read_text()


def test_grpc_overhead_smoke_run_matches_the_in_process_output(tmp_path: Path) -> None:
    run_benchmark("grpc_overhead.py", "--repeats", "1", "--max-new-tokens", "16", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "grpc_overhead.json").read_text())
    assert result["identical_outputs"] is True
    assert result["steps"] > 0 and result["services_ms_per_step"] > 0


def test_drafter_hop_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("drafter_hop.py", "--sessions", "1", "4", "--rounds", "5", "--out-dir", str(tmp_path))
    rows = json.loads((tmp_path / "drafter_hop.json").read_text())["rows"]
    assert [(r["sessions"], r["batches"]) for r in rows] == [(1, False), (1, True), (4, False), (4, True)]
    assert all(r["mean_nodes"] > 0 and r["cpu_us_per_session_step"] > 0 for r in rows)  # every draft found a tree


def test_seed_message_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("seed_message.py", "--rows", "8", "--width", "16", "--repeats", "1", "--out-dir", str(tmp_path))
    stages = json.loads((tmp_path / "seed_message.json").read_text())["stages_ms"]
    assert stages["total"] == pytest.approx(sum(ms for stage, ms in stages.items() if stage != "total"))
    assert "| features as a tensor (drafter) |" in (tmp_path / "seed_message.md").read_text()


def test_verifier_loop_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("verifier_loop.py", "--sessions", "3", "--tokens", "8", "--out-dir", str(tmp_path))
    rows = json.loads((tmp_path / "verifier_loop.json").read_text())["rows"]
    plain, speculative, adaptive, plain_stream, speculative_stream = rows
    assert plain["session_steps"] == plain_stream["session_steps"] == 3 * 8
    assert 0 < speculative["session_steps"] <= 3 * 8 and 0 < speculative_stream["session_steps"] <= 3 * 8
    assert [(r["budget_policy"], r["read"]) for r in rows] == [
        ("-", "service"), ("fixed", "service"), ("adaptive", "service"), ("-", "GenerateStream"),
        ("fixed", "GenerateStream")]
    assert all(r["loop_cpu_us_per_session_step"] > 0 for r in rows)


def test_ngram_drafter_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("ngram_drafter.py", "--contexts", "300", "--steps", "5", "--out-dir", str(tmp_path))
    rows = json.loads((tmp_path / "ngram_drafter.json").read_text())["rows"]
    assert [(r["text"], r["context"]) for r in rows] == [("repetitive", 300), ("varied", 300)]
    assert rows[0]["mean_tree_nodes"] > 0 and all(r["seed_ms"] > 0 and r["step_us_p50"] > 0 for r in rows)


def test_budget_simulation_smoke_run_writes_its_table(tmp_path: Path) -> None:
    run_benchmark("budget_simulation.py", "--sessions", "1", "--seeds", "2", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "budget_simulation.json").read_text())
    rows = result["rows"]
    # NOTE: 14 texts on 5 batch engines at --sessions, and on the long-context one at 1 and 4 sessions
    assert len(rows) == 5 * 14 + 2 * 14 and all(r["adaptive"] > 0 and r["vs_best"] > 0 for r in rows)
    assert {r["every"] for r in rows} == {1, 2, 3, 8, 20, 33}  # drafts that pay on some steps, or seldom
    assert sum(1 for r in rows if "random steps" in r["trees"]) == 2 * 7
    assert sum(1 for r in rows if "loops" in r["trees"]) == 2 * 7
    assert {r["sessions"] for r in rows if r["engine"] == "long-context"} == {1, 4}
    drawn = result["random_steps_alone"]  # NOTE: the two texts on random steps, on all six engines, 2 draws each
    assert len(drawn) == 2 * 6 and all(len(r["vs_best"]) == 2 and min(r["vs_best"]) > 0 for r in drawn)
    assert any(r["vs_best"][0] != r["vs_best"][1] for r in drawn)  # NOTE: other draws, other steps


def test_texts_on_random_steps_repeat_elsewhere_with_another_seed() -> None:
    from benchmarks.budget_simulation import Workload

    first, second = Workload(6, every=2, scattered=True), Workload(6, every=2, scattered=True, seed=1)
    steps = [[workload.lucky(made, 0) for made in range(200)] for workload in (first, second)]
    assert steps[0] != steps[1] and all(60 < sum(lucky) < 140 for lucky in steps)


def test_plan_cost_smoke_run_holds_plans_without_changing_the_probes(tmp_path: Path) -> None:
    run_benchmark("plan_cost.py", "--sessions", "8", "--passes", "200", "--out-dir", str(tmp_path))
    every, held = json.loads((tmp_path / "plan_cost.json").read_text())["rows"]
    assert every["planned"] == 200 and held["planned"] < 200
    assert every["drafting_passes"] == held["drafting_passes"] > 0


# (kernel name as the profiler gives it, its group): PyTorch's generic kernels by the operation they run
KERNEL_GROUPS = [
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNN", "GEMM (cuBLAS)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "GEMM (cuBLAS)"),
    ("_partials_kernel", "_partials_kernel"),
    ("_skinny_gemm_kernel", "_skinny_gemm_kernel"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}"
     "::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)",
     "vectorized_elementwise_kernel: silu_kernel"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
     "vectorized_elementwise_kernel: CUDAFunctor_add"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, "
     "float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, ...)",
     "elementwise_kernel: MulFunctor"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#3}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>, 4>(int, ...)",
     "unrolled_elementwise_kernel: direct_copy_kernel_cuda"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, "
     "float, 4, 4> >(at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int>)", "reduce_kernel: MaxOps"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
     "unsigned int, 2, 128, 1>(...)", "CatArrayBatchedCopy"),
    ("void at::native::radixSortKVInPlace<-2, -1, 32, 4, float, long>(...)", "radixSortKVInPlace"),
    ("void at_cuda_detail::cub::detail::scan::DeviceScanKernel<int>(int)", "DeviceScanKernel"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>(...)", "splitKreduce_kernel"),
    ("Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD"),
]


@pytest.mark.parametrize("name, group", KERNEL_GROUPS, ids=[group for _, group in KERNEL_GROUPS])
def test_kernel_groups_name_what_a_kernel_runs(name: str, group: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from e2e_step import kernel_group
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert kernel_group(name) == group


def test_gpu_only_benchmarks_import_and_parse_their_options() -> None:
    """The attention kernels' and MoE layer benchmarks have no CPU mode: at least their imports and options must
    hold."""
    run_benchmark("verify_attention.py", "--mla", "--help")
    run_benchmark("decode_attention.py", "--help")
    run_benchmark("draft_attention.py", "--help")
    run_benchmark("moe_layer.py", "--help")


def test_the_full_window_runs_from_the_last_first_token_to_the_first_finish(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from benchmarks.throughput import FullWindow

    snapshots = iter(range(10))
    window = FullWindow(2, lambda: next(snapshots))
    window.chunk(True, 1, 0.0)  # session a's first token: b has none yet
    window.chunk(False, 5, 0.5)  # before the window: not counted
    window.chunk(True, 1, 1.0)  # session b's first token opens it
    window.chunk(False, 4, 2.0)
    window.chunk(False, 6, 3.0)
    window.finish(3.0)  # a finishes: the window closes
    window.chunk(False, 9, 4.0)
    window.finish(4.0)
    assert window.tokens_per_s == pytest.approx(10 / 2.0) and window.snapshots == [0, 1]
    early = FullWindow(2, lambda: 0)
    early.chunk(True, 1, 0.0)
    early.finish(1.0)  # a finished before b started: no moment had both decoding
    early.chunk(True, 1, 2.0)
    assert early.tokens_per_s is None and early.snapshots == []


def test_budget_choices_take_zero_for_the_verifiers_own_budget(monkeypatch) -> None:
    """`--tree-budgets 0` (plain stacks' commands in throughput_decode_bursts.md) pins nothing; a word is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from benchmarks.throughput import budget_pins

    def refuse(message: str) -> None:
        raise SystemExit(message)  # NOTE: as the parser's error does

    assert budget_pins(["0", "7", "adaptive"], refuse) == {"0": 0, "7": 7, "adaptive": 0}
    with pytest.raises(SystemExit, match="'seven' is neither a budget >= 0 nor 'adaptive'"):
        budget_pins(["seven"], refuse)


def test_the_prefix_cache_benchmark_compares_two_stacks_on_the_same_requests(tmp_path: Path) -> None:
    """benchmarks/prefix_cache.py's CPU smoke mode: the stack with the cache found the shared prompt's full pages
    for every measured request, the one without found none, and both served the same prompts."""
    run_benchmark("prefix_cache.py", "--shape", "tiny", "--shared-prefix", "300", "--input-len", "20",
                  "--output-len", "4", "--requests", "3", "--concurrency", "1", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "prefix_cache_tiny.json").read_text())
    cached, plain = result["runs"]["prefix cache"], result["runs"]["no prefix cache"]
    assert cached["input_tokens"] == plain["input_tokens"] == 3 * 320
    assert (cached["cached_input_tokens"], plain["cached_input_tokens"]) == (3 * 256, 0)  # NOTE: 64-token pages
    assert "| prefix cache |" in (tmp_path / "prefix_cache_tiny.md").read_text()


def test_budget_replay_walks_every_policy_over_the_recorded_text(tmp_path: Path) -> None:
    """A text that repeats a 12-token phrase: every budget drafts it from the history, larger trees reach further
    into it, and plain decoding is slowest; the table names the recording."""
    phrase = list(range(1000, 1012))
    text = [500, 501, 502] + phrase * 20
    outputs = tmp_path / "long_context_tiny_outputs.json"
    outputs.write_text(json.dumps({"command": "recorded", "rows": [
        {"drafter": "ngram", "context": 300, "budget": "7", "document": 1, "run": 1, "token_ids": [text]},
        {"drafter": "none", "context": 300, "budget": "-", "document": 1, "run": 1, "token_ids": [text]}]}))
    run_benchmark("budget_replay.py", str(outputs), "--out-dir", str(tmp_path))
    (row,) = json.loads((tmp_path / "budget_replay_tiny.json").read_text())["rows"]  # plain decoding's left out
    rates = row["rates"]
    assert rates["0"] < rates["7"] < rates["15"] and rates["adaptive"] > rates["0"]
    assert "`recorded`" in (tmp_path / "budget_replay_tiny.md").read_text()


def test_budget_replay_fits_its_costs_to_the_runs_own_steps(monkeypatch) -> None:
    """--fit: the line through the fixed-budget runs' ms per step less their round, against rows a step (drafted
    nodes and the root); adaptive and plain runs left out."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from benchmarks.budget_replay import fitted_costs

    def run(drafter: str, budget: str, nodes: float, round_ms: float) -> dict:
        return {"drafter": drafter, "budget": budget, "drafted_nodes_per_step": nodes, "draft_round_ms": round_ms,
                "ms_per_step": 12.0 + 0.1 * (nodes + 1) + round_ms}

    runs = [run("ngram", "7", 2.0, 2.0), run("ngram", "15", 4.0, 2.5), run("ngram", "63", 9.0, 3.0),
            run("ngram", "adaptive", 40.0, 9.0), run("none", "-", 0.0, 0.0)]
    assert fitted_costs({"rows": runs}) == (12.0, 100.0, 2.5)
    with pytest.raises(SystemExit, match="two or more"):
        fitted_costs({"rows": runs[:1]})


def edited_repository(path: Path) -> str:
    """A git repository of two commits: a module, then the same module with one line changed 600 characters in.
    Returns the old and new versions' text joined by a NUL."""
    old = "".join(f"def function_{i}(value: int) -> int:\n    return value * {i} + {i % 7}\n\n\n" for i in range(40))
    new = old[:600] + "# NOTE: an edit\n" + old[600:]

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    path.mkdir()
    git("init", "-q")
    for version in (old, new):
        (path / "module.py").write_text(version)
        git("add", "module.py")
        git("commit", "-q", "-m", "a version")
    return old + "\0" + new


def test_code_edits_are_prompted_by_the_old_version_and_start_before_the_change(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from benchmarks.budget_replay import EDIT_LEAD, edit_texts
    from modeling.tiny import byte_level_tokenizer

    old, new = edited_repository(tmp_path / "repo").split("\0")
    (edit,) = edit_texts(tmp_path / "repo", "HEAD", 5, 100)  # NOTE: the first commit changes no file, it adds one
    tokenizer = byte_level_tokenizer()
    assert edit["path"] == "module.py" and edit["prompt"] == tokenizer.encode(old).ids
    assert edit["text"] == tokenizer.encode(new[600 - EDIT_LEAD:]).ids[:100]
    assert edit_texts(tmp_path / "repo", "HEAD", 5, 10_000) == []  # NOTE: shorter than asked: left out


def test_budget_replay_of_code_edits_runs_every_engine_alone_and_together(tmp_path: Path) -> None:
    """The edit repeats its prompt but for one line: drafting beats plain decoding alone on every engine."""
    edited_repository(tmp_path / "repo")
    run_benchmark("budget_replay.py", "--git-edits", str(tmp_path / "repo"), "--tokens", "256", "--out-dir",
                  str(tmp_path))
    result = json.loads((tmp_path / "budget_replay_edits.json").read_text())
    assert [edit["path"] for edit in result["edits"]] == ["module.py"] and len(result["rows"]) == 6
    for row in result["rows"]:
        (alone,) = row["alone"]
        assert row["batch_sessions"] == 1 and max(alone[b] for b in ("7", "15", "31", "63")) > alone["0"]
    assert "| long-context |" in (tmp_path / "budget_replay_edits.md").read_text()


def test_a_recorded_text_accepts_the_path_it_follows(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from benchmarks.budget_replay import RecordedText
    from modeling.tree import DraftTree

    text = RecordedText([1, 2, 3], [7, 8, 9, 4])
    # root -> 8 (0), root -> 5 (1); 8 -> 6 (2), 8 -> 9 (3); 9 -> 4 (4): after the first token (7) the text is 8 9 4
    tree = DraftTree((8, 5, 6, 9, 4), (-1, -1, 0, 0, 3), (1, 1, 2, 2, 3))
    assert text.path(tree, 1, True) == [0, 3, 4]
    assert text.path(tree, 2, True) == [] and text.path(DraftTree.empty(), 1, True) == []
