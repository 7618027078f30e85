"""`ddtree bench`: the report's math and the Poisson schedule; the gRPC backend against the real local stack on
the tiny model; the OpenAI backend against a small fake OpenAI-compatible SSE server (aiohttp.web)."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import threading
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from ddtree import cli
from ddtree.bench import (
    BenchRequest,
    Progress,
    RequestRecord,
    dataset_requests,
    percentile,
    poisson_arrivals,
    run_load,
    summarize,
    synthetic_requests,
)
from ddtree.bench_backends import OpenAIBackend, sse_data
from ddtree.local_stack import LocalStack, free_port
from tests.test_cli import Terminal


def test_percentile_interpolates_as_numpy() -> None:
    values = list(np.random.default_rng(0).exponential(size=101))
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([3.0], 99) == 3.0


def test_a_chunk_of_k_tokens_is_k_inter_token_latencies() -> None:
    record = RequestRecord(sent_at=10.0)
    for tokens, now in ((1, 10.1), (2, 10.3), (1, 10.4)):
        record.add_chunk(tokens, now)
    record.finish(10.5)
    assert record.ttft_s == pytest.approx(0.1) and record.e2e_s == pytest.approx(0.5)
    assert record.itl_s == pytest.approx([0.1, 0.1, 0.1])
    assert record.output_tokens == 4 and record.tpot_s == pytest.approx(0.4 / 3)


def record(ttft: float, e2e: float, tokens: int, acceptance: list[int] | None = None, error: str | None = None,
           input_tokens: int | None = 5) -> RequestRecord:
    """A finished request whose tokens came one per chunk, evenly spread after the first."""
    result = RequestRecord(sent_at=0.0, input_tokens=input_tokens, acceptance_lengths=acceptance, error=error)
    result.add_chunk(1, ttft)
    for i in range(1, tokens):
        result.add_chunk(1, ttft + i * (e2e - ttft) / (tokens - 1))
    result.finish(e2e)
    return result


def test_the_report_counts_failures_apart_and_weights_acceptance_by_step() -> None:
    records = [record(0.1, 1.1, 11, [1, 3, 2]), record(0.3, 2.3, 11, [4]),
               record(0.2, 0.5, 3, error="UNAVAILABLE: gone"), record(0.2, 0.5, 3, error="UNAVAILABLE: gone")]
    report = summarize(records, duration_s=4.0)
    assert (report["requests"], report["completed"], report["failed"]) == (4, 2, 2)
    assert report["errors"] == ["UNAVAILABLE: gone"]
    assert report["output_lengths"] == [11, 11, None, None]
    assert (report["input_tokens"], report["output_tokens"]) == (10, 22)
    assert report["request_throughput"] == 0.5 and report["output_throughput"] == 5.5
    assert report["mean_acceptance_length"] == 2.5  # (1 + 3 + 2 + 4) / 4 steps, not the mean of 2 and 4
    assert report["ttft_ms"] == pytest.approx({"mean": 200, "p50": 200, "p90": 280, "p99": 298})
    assert report["e2e_ms"]["mean"] == pytest.approx(1700)
    assert report["tpot_ms"]["p50"] == pytest.approx(150)  # (100 ms + 200 ms) / 2
    assert report["itl_ms"]["mean"] == pytest.approx(150) and report["itl_ms"]["p90"] == pytest.approx(200)


def test_unknown_input_counts_and_acceptance_are_none() -> None:
    report = summarize([record(0.1, 0.2, 1, input_tokens=None)], duration_s=1.0)
    assert report["input_tokens"] is None and report["mean_acceptance_length"] is None
    assert report["tpot_ms"] is None and report["itl_ms"] is None  # one token: no gaps


def test_poisson_arrivals_are_seeded_with_the_mean_rate() -> None:
    arrivals = poisson_arrivals(20000, rate=50.0, seed=1)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)  # the standard error is 0.7%
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: std = mean
    assert poisson_arrivals(20000, 50.0, seed=1) == arrivals != poisson_arrivals(20000, 50.0, seed=2)
    assert poisson_arrivals(3, float("inf"), seed=1) == [0.0, 0.0, 0.0]


class SleepyBackend:
    """Each request takes 20 ms and yields one token; counts the requests in flight."""
    errors = (RuntimeError,)

    def __init__(self) -> None:
        self.in_flight = self.most_in_flight = 0

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.02)
        self.in_flight -= 1
        if request.text == "fail":
            raise RuntimeError("refused")
        record.add_chunk(1, record.sent_at + 0.01)


def test_load_keeps_to_the_concurrency_and_counts_failures() -> None:
    backend = SleepyBackend()
    requests = [BenchRequest("fail" if i == 3 else "", (), 1) for i in range(9)]
    records, duration_s = asyncio.run(run_load(backend, requests, float("inf"), concurrency=3, seed=0))
    assert backend.most_in_flight == 3 and 0.055 <= duration_s < 1.0
    assert [r.error for r in records] == [None] * 3 + ["refused"] + [None] * 5


def test_requests_are_not_sent_before_their_arrival() -> None:
    requests = [BenchRequest("", (), 1)] * 5
    records, _ = asyncio.run(run_load(SleepyBackend(), requests, rate=20.0, concurrency=None, seed=3))
    started = records[0].sent_at
    for r, arrival in zip(records, poisson_arrivals(5, 20.0, seed=3)):
        assert r.sent_at - started >= arrival - 0.002


def test_synthetic_prompts_have_the_asked_lengths_and_differ() -> None:
    by_ids = synthetic_requests(4, 7, 3, seed=0, token_pool=[5, 6, 7])
    assert all(len(r.token_ids) == 7 and set(r.token_ids) <= {5, 6, 7} and r.max_tokens == 3 for r in by_ids)
    by_text = synthetic_requests(4, 7, 3, seed=0, token_pool=None)
    assert all(len(r.text.split()) == 7 and not r.token_ids for r in by_text)
    assert len({r.text for r in by_text}) == 4
    assert synthetic_requests(4, 7, 3, seed=0, token_pool=None) == by_text
    shared = synthetic_requests(3, 5, 2, seed=1, token_pool=range(100), shared_prefix_len=4)
    assert len({r.token_ids[:4] for r in shared}) == 1 and len({r.token_ids for r in shared}) == 3
    assert all(len(r.token_ids) == 9 for r in shared)
    worded = synthetic_requests(3, 5, 2, seed=1, token_pool=None, shared_prefix_len=4)
    assert len({tuple(r.text.split()[:4]) for r in worded}) == 1 and all(len(r.text.split()) == 9 for r in worded)


def test_dataset_lines_and_a_bad_line_named(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 4}\n\n{"prompt": "b"}\n')
    assert dataset_requests(str(path), 9) == [BenchRequest("a", (), 4), BenchRequest("b", (), 9)]
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: expected"):
        dataset_requests(str(path), 9)


def test_sse_events_are_joined_data_lines() -> None:
    lines = [b": comment\n", b"data: {\"a\":\n", b"data: 1}\r\n", b"\r\n", b"event: x\n", b"data:[DONE]\n"]

    async def stream():
        for line in lines:
            yield line

    async def collect() -> list[str]:
        return [data async for data in sse_data(stream())]
    assert asyncio.run(collect()) == ['{"a":\n1}', "[DONE]"]


def test_progress_shows_on_a_terminal_only() -> None:
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = Progress(4, stream, width=8)
        progress.advance(failed=False)
        progress.advance(failed=True)
        progress.close()
    assert terminal.getvalue() == "\r[##......] 1/4\r[####....] 2/4 (failures)\n"
    assert pipe.getvalue() == ""


def test_the_cli_imports_no_torch() -> None:
    code = ("import sys, ddtree.cli, ddtree.bench_backends; ddtree.cli.build_parser().parse_args(['bench', "
            "'--address', 'x']); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def bench(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> tuple[dict, str]:
    """Run `ddtree bench`; its JSON report and its stdout."""
    report = tmp_path / "report.json"
    assert cli.main(["bench", *argv, "--json", str(report)]) == 0
    return json.loads(report.read_text()), capsys.readouterr().out


def assert_latencies_sane(report: dict) -> None:
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] and stats["mean"] > 0, key
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"]
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0


def test_grpc_bench_against_the_local_stack(tiny_target, tmp_path, capsys) -> None:
    with LocalStack(str(tiny_target), "ngram", gateway_listen=f"127.0.0.1:{free_port()}",
                    log_dir=tmp_path / "logs") as stack:
        report, out = bench(capsys, tmp_path, "--address", stack.addresses["gateway"], "--concurrency", "2",
                            "--num-requests", "4", "--input-len", "12", "--output-len", "6", "--ignore-eos",
                            "--request-rate", "50")
    assert (report["completed"], report["failed"], report["errors"]) == (4, 0, [])
    assert report["output_lengths"] == [6] * 4 and report["output_tokens"] == 24
    assert report["input_tokens"] == 4 * 12  # token ids: exact
    assert report["mean_acceptance_length"] >= 1.0
    assert (report["concurrency"], report["request_rate"], report["model"]) == (2, 50.0, tiny_target.name)
    assert_latencies_sane(report)
    assert out.startswith("| requests | failed |") and "| TTFT |" in out
    assert report["cached_input_tokens"] == 0


def test_grpc_bench_with_a_shared_prefix_reports_the_prefix_caches_hits(tiny_target, tmp_path, capsys) -> None:
    """Prompts that begin with 140 tokens in common: after the warm-up request, each finds two 64-token pages of
    them in the verifier's prefix cache."""
    with LocalStack(str(tiny_target), "ngram", gateway_listen=f"127.0.0.1:{free_port()}",
                    log_dir=tmp_path / "logs") as stack:
        report, _ = bench(capsys, tmp_path, "--address", stack.addresses["gateway"], "--concurrency", "1",
                          "--num-requests", "3", "--input-len", "12", "--shared-prefix-len", "140",
                          "--output-len", "4", "--ignore-eos")
    assert (report["completed"], report["input_tokens"]) == (3, 3 * 152)
    assert report["cached_input_tokens"] == 3 * 128 and report["shared_prefix_len"] == 140


def fake_openai_app() -> web.Application:
    """/v1/models and a streamed /v1/completions: 'x' per token, one per chunk, usage at the end; a prompt
    'pairs' gets 'xx' chunks each with its cumulative usage (vLLM's continuous_usage_stats), 'fail' HTTP 500."""
    async def models(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer sk-test":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["model"] == "fake-model" and body["stream"] is True
        assert request.headers.get("Authorization") == "Bearer sk-test"
        if body["prompt"] == "fail":
            return web.Response(status=500, text="internal error")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        per_chunk, sent = (2 if body["prompt"] == "pairs" else 1), 0
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": 0}
        while sent < body["max_tokens"]:
            await asyncio.sleep(0.005)
            sent += per_chunk
            event = {"choices": [{"index": 0, "text": "x" * per_chunk, "finish_reason": None}]}
            if per_chunk == 2:
                event["usage"] = {**usage, "completion_tokens": sent}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(f"data: {json.dumps({'choices': [], 'usage': {**usage, 'completion_tokens': sent}})}"
                             "\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture(scope="module")
def fake_openai() -> Iterator[str]:
    """The fake server's base URL; it runs on an event loop in a thread of its own."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake_openai_app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    host, port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://{host}:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def test_openai_bench_against_a_fake_server(fake_openai, tmp_path, capsys) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(line) + "\n" for line in (
        {"prompt": "one two three", "max_tokens": 3}, {"prompt": "fail", "max_tokens": 2},
        {"prompt": "four five", "max_tokens": 5})))
    report, out = bench(capsys, tmp_path, "--backend", "openai", "--address", fake_openai + "/v1", "--api-key",
                        "sk-test", "--dataset", str(dataset), "--num-requests", "6", "--concurrency", "3",
                        "--warmup", "0")
    assert (report["completed"], report["failed"], report["model"]) == (4, 2, "fake-model")
    assert report["errors"] == ["HTTP 500: internal error"]
    assert report["output_lengths"] == [3, None, 5] * 2
    assert report["input_tokens"] == 2 * (3 + 2) and report["mean_acceptance_length"] is None
    assert_latencies_sane(report)
    assert "| 4 | 2 |" in out and out.splitlines()[2].endswith("| n/a |")


def test_openai_chunks_with_cumulative_usage_count_their_tokens(fake_openai) -> None:
    args = Namespace(address=fake_openai, api_key="sk-test", model=None, ignore_eos=False, timeout=30,
                     temperature=0.0, tls=False, tls_ca=None, tls_cert=None, tls_key=None)

    async def one() -> RequestRecord:
        backend = await OpenAIBackend.open(args)
        record = RequestRecord(sent_at=0.0)
        await backend.send(BenchRequest("pairs", (), 6), record)
        await backend.close()
        return record
    record = asyncio.run(one())
    assert record.output_tokens == 6 and len(record.itl_s) == 4  # chunks of 2: the first is TTFT


def test_openai_bench_without_the_key_fails_in_one_line(fake_openai, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--backend", "openai", "--address", fake_openai, "--num-requests", "1"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err == f'error: {fake_openai}/v1/models: HTTP 401: {{"error": {{"message": "bad key"}}}}\n'
