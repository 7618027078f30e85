"""The real services over real gRPC on loopback: gateway -> verifier <-> two DFlash drafter replicas,
each a separate process (the local stack), against `ddtree offline` computed in this process."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from ddtree.client import AsyncClient, Client
from ddtree.local_stack import LocalStack, free_port
from ddtree.offline import generate_offline
from modeling.tiny import make_tiny_drafter
from proto import common_pb2, gateway_pb2
from tests import stack_helpers
from tests.engine_helpers import make_engine
from tests.stack_helpers import greedy_reference, kv_budget_mb, verifier_info
from verifier_service.engine.sampling import SamplingParams

MAX_NEW = 24
KV_PAGES = 160  # of 16 tokens: the verifier's --kv-budget-mb below holds exactly this many
PREFILL_CHUNK = 64


@pytest.fixture(scope="module")
def stack(tiny_target, tmp_path_factory):
    drafter = make_tiny_drafter(tmp_path_factory.mktemp("dflash"), tiny_target, seed=1)
    metrics_port = free_port()
    stack = LocalStack(str(tiny_target), str(drafter), drafters=2, gateway_listen=f"127.0.0.1:{free_port()}",
                       verifier_args=("--page-size", "16", "--kv-budget-mb", kv_budget_mb(KV_PAGES),
                                      "--max-context", "4096", "--metrics-port", str(metrics_port),
                                      "--tree-budget", "8", "--prefill-chunk", str(PREFILL_CHUNK)),
                       log_dir=tmp_path_factory.mktemp("logs"))
    stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with stack:
        assert verifier_info(stack).drafters_connected == 2  # NOTE: the stack starts once they are (LocalStack.start)
        yield stack


@pytest.fixture(scope="module")
def reference(tiny_target):
    return greedy_reference(tiny_target, MAX_NEW)


def client(stack) -> Client:
    return Client(stack.addresses["gateway"], timeout=60)


def verifier_metric(stack, name: str, label: str = "") -> float:
    return stack_helpers.verifier_metric(stack.metrics_url, name, label)


def free_pages(stack) -> int:
    return verifier_info(stack).free_pages


def test_greedy_through_the_gateway_equals_offline(stack, reference) -> None:
    text = "speculation must not change a single token"
    generation = client(stack).generate(text, max_new_tokens=MAX_NEW)
    chunks = list(generation)
    assert generation.token_ids == reference(reference.encode(text))
    assert sum(len(c.token_ids) for c in chunks) == len(generation.token_ids)
    assert generation.summary.mean_acceptance_length >= 1.0 and generation.summary.ttft_ms > 0


def test_three_turns_equal_one_generation_over_the_concatenation(stack, reference) -> None:
    """Exact at every turn; the session's drafter mirror stays open between its turns (each later turn's first
    draft carries the tokens since, not a seed)."""
    c = client(stack)
    turns = ["first turn. ", "second turn! ", "third?"]
    history: list[int] = []
    handle = ""
    resumes = verifier_metric(stack, "ddtree_verifier_mirror_resumes")
    for turn in turns:
        generation = c.generate(turn, session=handle or None, keep_session=True, max_new_tokens=MAX_NEW)
        generation.result()
        handle = generation.summary.session
        history += reference.encode(turn)
        assert generation.token_ids == reference(history)
        history += generation.token_ids
    c.release_session(handle)
    assert verifier_metric(stack, "ddtree_verifier_mirror_resumes") == resumes + 2


def prefill_progress(events: list) -> list[tuple[int, int]]:
    """The PrefillProgress events, which must all come before the first chunk, as (prefilled, total)."""
    progress = [(e.prefilled_tokens, e.total_tokens) for e in events if isinstance(e, common_pb2.PrefillProgress)]
    assert all(isinstance(e, gateway_pb2.GenerateChunk) for e in events[len(progress):])
    return progress


def test_a_long_prefill_reports_its_progress_on_the_stream(stack, reference) -> None:
    """A prompt (or an appended turn) longer than one prefill chunk sends how far its prefill got between the
    chunks, before the first generated chunk; one that fits a chunk sends nothing. The output stays exact."""
    c = client(stack)
    prompt = [1 + i % 250 for i in range(300)]
    generation = c.generate(token_ids=prompt, keep_session=True, max_new_tokens=MAX_NEW)
    assert prefill_progress(list(generation.events())) == [(64, 299), (128, 299), (192, 299), (256, 299)]
    assert generation.token_ids == reference(prompt)
    history = prompt + generation.token_ids
    turn = [1 + i % 200 for i in range(150)]
    appended = c.generate(token_ids=turn, session=generation.summary.session, max_new_tokens=MAX_NEW)
    first_chunk = PREFILL_CHUNK - (len(history) - 1) % PREFILL_CHUNK  # NOTE: chunks end at multiples of the size
    expected = [(done, 150) for done in range(first_chunk, 150, PREFILL_CHUNK)]
    assert prefill_progress(list(appended.events())) == expected and len(expected) >= 2
    assert appended.token_ids == reference(history + turn)
    c.release_session(generation.summary.session)
    short = c.generate(token_ids=prompt[:PREFILL_CHUNK], max_new_tokens=MAX_NEW)
    assert prefill_progress(list(short.events())) == [] and short.token_ids == reference(prompt[:PREFILL_CHUNK])


def test_fork_continues_both_branches_exactly(stack, reference) -> None:
    c = client(stack)
    base = c.generate("a shared prefix for two branches", keep_session=True, max_new_tokens=MAX_NEW)
    base.result()
    history = reference.encode("a shared prefix for two branches") + base.token_ids
    fork = c.fork_session(base.summary.session).session
    assert c.get_session(fork).pages_shared > 0
    for handle, turn in ((base.summary.session, " left"), (fork, " right")):
        generation = c.generate(turn, session=handle, max_new_tokens=MAX_NEW)
        assert generation.result() and generation.token_ids == reference(history + reference.encode(turn))
        c.release_session(handle)


def test_concurrent_clients_are_exact_use_both_replicas_and_leak_no_pages(stack, reference) -> None:
    prompts = [f"client {i} asks: what comes next after {i * 7}?" for i in range(32)]
    before = {r: verifier_metric(stack, "ddtree_verifier_trees", f'{{replica="drafter-{r}"}}') for r in (0, 1)}

    async def run_all() -> list[list[int]]:
        c = AsyncClient(stack.addresses["gateway"], timeout=120)

        async def one(prompt: str) -> list[int]:
            generation = c.generate(prompt, max_new_tokens=MAX_NEW)
            await generation.result()
            return generation.token_ids
        return await asyncio.gather(*(one(p) for p in prompts))

    outputs = asyncio.run(run_all())
    assert outputs == [reference(reference.encode(p)) for p in prompts]
    after = {r: verifier_metric(stack, "ddtree_verifier_trees", f'{{replica="drafter-{r}"}}') for r in (0, 1)}
    assert all(after[r] > before[r] for r in (0, 1)), (before, after)
    assert free_pages(stack) == KV_PAGES


def test_bad_inputs_get_their_status_codes(stack) -> None:
    c = client(stack)
    cases = [
        (lambda: c.generate("", max_new_tokens=4).result(), grpc.StatusCode.INVALID_ARGUMENT, "text"),
        (lambda: c.generate("x" * 4100, max_new_tokens=4).result(), grpc.StatusCode.INVALID_ARGUMENT, "context"),
        (lambda: c.generate("hi", temperature=-1.0).result(), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (lambda: c.generate("hi", top_p=7.0).result(), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (lambda: c.generate("hi", session="0" * 48).result(), grpc.StatusCode.NOT_FOUND, ""),
    ]
    for call, code, field in cases:
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == code and field in error.value.details(), error.value.details()


def test_kv_full_is_resource_exhausted_and_spares_other_sessions(stack, reference) -> None:
    c = client(stack)
    keep = c.generate("a session that must survive", keep_session=True, max_new_tokens=4)
    keep.result()
    with pytest.raises(grpc.RpcError) as error:
        c.generate("y" * 3000, max_new_tokens=4).result()  # 188 pages of 16 tokens > 160
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    generation = c.generate(" and it does", session=keep.summary.session, max_new_tokens=MAX_NEW)
    history = reference.encode("a session that must survive") + keep.token_ids + reference.encode(" and it does")
    assert generation.result() and generation.token_ids == reference(history)
    c.release_session(keep.summary.session)
    assert free_pages(stack) == KV_PAGES


@pytest.mark.parametrize("keep", [False, True])
def test_cancel_mid_stream_stops_and_releases_or_keeps(stack, keep: bool) -> None:
    c = client(stack)
    generation = c.generate("cancel me after the first chunk", keep_session=keep, max_new_tokens=1500,
                            ignore_eos=True)
    next(iter(generation))
    generation.cancel()

    def settled() -> bool:
        if not keep:
            return verifier_info(stack).active_sessions == 0
        return not c.list_sessions()[0].generating

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not settled():
        time.sleep(0.05)
    assert settled()
    assert verifier_info(stack).active_sessions == (1 if keep else 0)
    if keep:
        (session,) = c.list_sessions()
        assert session.num_tokens < 1500
        c.release_session(session.session)
    assert free_pages(stack) == KV_PAGES


def test_killing_a_drafter_mid_generation_keeps_the_output_exact(stack, reference) -> None:
    text = "a long generation that outlives one of the drafters"
    c = client(stack)
    reseeds = verifier_metric(stack, "ddtree_verifier_reseeds")
    failures: list[BaseException] = []

    def finish(generation) -> None:
        try:
            generation.result()
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            failures.append(error)

    generations = [c.generate(f"{text} #{i}", max_new_tokens=150, ignore_eos=True) for i in range(4)]
    threads = [threading.Thread(target=finish, args=(g,)) for g in generations]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stack.kill("drafter-1")
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert all(g.summary.stop_reason == common_pb2.STOP_REASON_LENGTH for g in generations)
    engine_params = SamplingParams(max_new_tokens=150, ignore_eos=True)
    engine = make_engine(stack.target, page_size=64)
    for i, generation in enumerate(generations):
        prompt = reference.encode(f"{text} #{i}")
        assert generation.token_ids == generate_offline(engine, None, prompt, engine_params).token_ids
    assert verifier_metric(stack, "ddtree_verifier_reseeds") > reseeds
