"""benchmarks/long_context.py runs rarely, on a GPU host and at contexts of 32k-185k tokens: its CPU smoke mode
(the tiny model, a 512-token context) runs here, through the real services, so that a change that breaks it
shows in CI."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tests.test_benchmarks import ROOT, run_benchmark


def test_smoke_run_reports_ttft_decode_rate_step_times_and_acceptance(tmp_path: Path) -> None:
    run_benchmark("long_context.py", "--shape", "tiny", "--contexts", "512", "--drafters", "ngram", "none",
                  "--max-new-tokens", "24", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "long_context_tiny.json").read_text())
    (run,) = result["runs"]
    assert "long_context.py --shape tiny --contexts 512 --drafters ngram none" in run["command"]
    assert set(run["stack_start_s"]) == {"ngram", "none"}
    rows = {row["drafter"]: row for row in result["rows"]}
    assert set(rows) == {"ngram", "none"}
    for row in rows.values():
        assert (row["context"], row["sessions"], row["prompt_tokens"], row["output_tokens"]) == (512, 1, 512, 24)
        assert row["ttft_ms"] > 0 and row["prefill_messages"] >= 1  # 512 tokens: two prefill chunks
        assert row["decode_tokens_per_s"] > 0 and row["ms_per_step"] > 0 and row["verifier_step_ms"] > 0
        assert row["mean_acceptance_length"] >= 1 and row["draft_misses"] == 0
    # the verifier counted the steps the gateway streamed: plain decoding one token each
    assert rows["none"]["steps"] == 24 and rows["none"]["mean_acceptance_length"] == 1
    assert rows["ngram"]["steps"] < 24 and rows["ngram"]["mean_acceptance_length"] > 1
    assert rows["none"]["draft_round_ms"] is None and rows["none"]["drafter_compute_ms"] is None
    assert 0 < rows["ngram"]["drafter_compute_ms"] < rows["ngram"]["draft_round_ms"]  # the round holds the hop too
    assert rows["ngram"]["seed_ms"] > 0 and rows["none"]["seed_ms"] is None  # the first draft opens
    assert rows["none"]["plain_step_host_ms"] > 0 and rows["none"]["step_gap_ms"] > 0
    assert rows["ngram"]["drafting_pass_host_ms"] > 0
    assert rows["ngram"]["engine_gpu_ms"] is None and rows["none"]["step_host_overhead_ms"] is None  # NOTE: no CUDA
    assert rows["none"]["speedup_vs_plain"] == 1
    assert rows["ngram"]["speedup_vs_plain"] > 0
    table = (tmp_path / "long_context_tiny.md").read_text()
    assert run["command"] in table and "| 512 | ngram | - | 1 | 1 |" in table and "| 512 | none | - | 1 | 1 |" in table


def test_documents_run_every_choice_on_each_and_take_medians_over_all(tmp_path: Path) -> None:
    run_benchmark("long_context.py", "--shape", "tiny", "--contexts", "300", "--drafters", "ngram",
                  "--tree-budgets", "3", "adaptive", "--documents", "2", "--max-new-tokens", "16",
                  "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "long_context_tiny.json").read_text())
    assert result["settings"]["documents"] == 2
    # the second document's runs take the choices in reverse order
    assert [(r["budget"], r["document"], r["run"]) for r in result["rows"]] == [
        ("3", 1, 1), ("adaptive", 1, 1), ("adaptive", 2, 1), ("3", 2, 1)]
    table = (tmp_path / "long_context_tiny.md").read_text()
    assert "| 300 | ngram | 3 | 2 | 1 |" in table
    median = statistics.median(r["decode_tokens_per_s"] for r in result["rows"] if r["budget"] == "3")
    assert f"| 300 | ngram | 3 | 2 | {median:.1f} | 1.00x |" in table  # medians over both documents


def test_documents_split_over_calls_merge_as_one_run(tmp_path: Path) -> None:
    """Documents 1 and 2 in two calls (--first-document 2 --merge): the rows and saved texts of both, the second
    call's document opened as a one-call run's second is, its choices in reverse order as there."""
    common = ("long_context.py", "--shape", "tiny", "--contexts", "300", "--drafters", "ngram", "--tree-budgets",
              "3", "adaptive", "--max-new-tokens", "12", "--save-outputs", "--out-dir", str(tmp_path))
    run_benchmark(*common)
    first = json.loads((tmp_path / "long_context_tiny_outputs.json").read_text())["rows"]
    run_benchmark(*common, "--first-document", "2", "--merge")
    result = json.loads((tmp_path / "long_context_tiny.json").read_text())
    assert len(result["runs"]) == 2 and "--first-document 2 --merge" in result["runs"][1]["command"]
    assert [(r["budget"], r["document"]) for r in result["rows"]] == [
        ("3", 1), ("adaptive", 1), ("adaptive", 2), ("3", 2)]
    saved = json.loads((tmp_path / "long_context_tiny_outputs.json").read_text())
    assert [(o["budget"], o["document"]) for o in saved["rows"]] == [("3", 1), ("adaptive", 1), ("adaptive", 2),
                                                                     ("3", 2)]
    assert saved["rows"][:2] == first and "; then " in saved["command"]
    # fp32: greedy is exact, so a document's runs agree, and the second document's opening writes another text
    by_document = {o["document"]: o["token_ids"] for o in saved["rows"]}
    assert by_document[1] == first[0]["token_ids"] and by_document[2] != by_document[1]


def test_shared_prefill_runs_every_choice_on_forks_of_one_prefill(tmp_path: Path) -> None:
    """Each document's sessions prefilled once; every run generates on forks of them (no prefill of its own): the
    same rows, in the same order, as without."""
    run_benchmark("long_context.py", "--shape", "tiny", "--contexts", "300", "--drafters", "ngram",
                  "--tree-budgets", "3", "adaptive", "--documents", "2", "--max-new-tokens", "16", "--sessions", "2",
                  "--shared-prefill", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "long_context_tiny.json").read_text())
    assert result["settings"]["shared_prefill"] is True
    assert [(r["budget"], r["document"]) for r in result["rows"]] == [
        ("3", 1), ("adaptive", 1), ("adaptive", 2), ("3", 2)]
    for row in result["rows"]:
        assert row["prompt_tokens"] == 0 and row["prefill_messages"] == 0  # the forks prefill nothing
        assert row["document_prefill_ms"] > 0 and row["output_tokens"] == 2 * 16 and row["steps"] > 0
    first_document = [r for r in result["rows"] if r["document"] == 1]
    assert first_document[0]["document_prefill_ms"] == first_document[1]["document_prefill_ms"]  # one prefill
    assert "--shared-prefill each document's sessions were prefilled once" in (
        tmp_path / "long_context_tiny.md").read_text()


def test_each_document_opens_every_session_differently(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from benchmarks.throughput import prompts

    first, second = prompts(2, 200), prompts(2, 200, document=1)
    assert first[0].startswith("Session 0. ") and first[1].startswith("Session 1. ")  # as before documents
    assert len(set(first + second)) == 4 and second[1].startswith("Document 1, session 1. ")


def test_tree_budgets_run_each_choice_on_one_stack_against_the_best_fixed(tmp_path: Path) -> None:
    run_benchmark("long_context.py", "--shape", "tiny", "--contexts", "300", "--drafters", "ngram",
                  "--tree-budgets", "3", "7", "adaptive", "--repeats", "2", "--max-new-tokens", "24",
                  "--save-outputs", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "long_context_tiny.json").read_text())
    settings = result["settings"]
    assert (settings["budget_policy"], settings["tree_budget"], settings["repeats"]) == ("adaptive", 7, 2)
    assert set(result["runs"][0]["stack_start_s"]) == {"ngram"}
    # every other repeat in reverse order
    assert [(r["budget"], r["run"]) for r in result["rows"]] == [
        ("3", 1), ("7", 1), ("adaptive", 1), ("adaptive", 2), ("7", 2), ("3", 2)]
    for row in result["rows"]:
        if row["budget"] != "adaptive":  # pinned by the requests
            assert row["mean_tree_budget"] == int(row["budget"])
        else:  # the verifier's policy, within its maximum
            assert 0 <= row["mean_tree_budget"] <= 7
        assert row["vs_best_fixed"] > 0
        assert row["same_tokens_as_first_run"] == 24  # fp32: greedy is exact whatever each step verifies
    outputs = json.loads((tmp_path / "long_context_tiny_outputs.json").read_text())["rows"]
    assert [(o["budget"], o["run"]) for o in outputs] == [(r["budget"], r["run"]) for r in result["rows"]]
    assert all(o["token_ids"] == outputs[0]["token_ids"] and len(o["token_ids"][0]) == 24 for o in outputs)
    medians = {b: statistics.median(r["decode_tokens_per_s"] for r in result["rows"] if r["budget"] == b)
               for b in ("3", "7", "adaptive")}
    best = max(medians["3"], medians["7"])
    table = (tmp_path / "long_context_tiny.md").read_text()
    assert "| 300 | ngram | adaptive | 1 | 2 |" in table  # the second run's row (document 1)
    assert f"| 300 | ngram | adaptive | 2 | {medians['adaptive']:.1f} | {medians['adaptive'] / best:.2f}x |" in table


def test_help_and_a_verifier_option_it_does_not_have() -> None:
    run_benchmark("long_context.py", "--help")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_context.py"), "--shape", "tiny",
                              "--verifier-arg", "--no-such-option 1"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "--no-such-option" in refused.stderr
    for words, message in ((["--tree-budgets", "seven"], "neither a budget"),
                           (["--tree-budgets", "adaptive", "--budget-policy", "fixed"], "adaptive policy")):
        refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_context.py"), "--shape", "tiny",
                                  *words], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr


def test_context_sizes_take_k_suffixes() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from long_context import context_label, context_tokens
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert [context_tokens(text) for text in ("32k", "128K", "185k", "512")] == [32768, 131072, 189440, 512]
    assert [context_label(tokens) for tokens in (32768, 189440, 512)] == ["32k", "185k", "512"]


def test_chat_turns_resume_each_sessions_mirror_after_the_first_turn(tmp_path: Path) -> None:
    """benchmarks/chat_turns.py's CPU smoke run: two sessions of three turns with the tiny DFlash drafter; the first
    turn seeds both mirrors, the later ones resume them."""
    run_benchmark("chat_turns.py", "--shape", "tiny", "--context", "300", "--turns", "3", "--sessions", "2",
                  "--max-new-tokens", "16", "--turn-tokens", "40", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "chat_turns_tiny.json").read_text())
    assert [(r["turn"], r["seeds"], r["mirror_resumes"]) for r in result["rows"]] == [(1, 2, 0), (2, 0, 2), (3, 0, 2)]
    assert [r["prompt_tokens"] for r in result["rows"]] == [300, 40, 40]
    assert all(r["decode_tokens_per_s"] > 0 and r["ttft_ms"] > 0 and r["draft_misses"] == 0 for r in result["rows"])
    assert "| 2 | 40 |" in (tmp_path / "chat_turns_tiny.md").read_text()
