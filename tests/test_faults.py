"""Faults and abuse against the real stack: gateway, verifier and an n-gram drafter as processes on loopback.

Each test cancels, freezes (SIGSTOP), kills or restarts a process, or sends input meant to hurt; it asserts
the exact output where a generation completes, the status a client gets, and that the verifier's KV pages
return to where they started. Times are bounded by client deadlines and short service timeouts."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from ddtree.client import Client, GatewayError
from ddtree.local_stack import LocalStack, free_port
from proto import common_pb2, gateway_pb2
from tests.stack_helpers import greedy_reference, kv_budget_mb, verifier_info, verifier_metric

Code = grpc.StatusCode
KV_PAGES = 600  # of 16 tokens: 9600 KV tokens; each key may hold half of them
LEASE_S = 3.0
DRAFT_TIMEOUT_S = 1.0
KEYS = ("k-alice", "k-bob")
LONG_PROMPT = [1 + i % 250 for i in range(3000)]  # prefills in ~1-2 s: 188 chunks of 16 tokens


@pytest.fixture(scope="module")
def stack(tiny_target, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fault-logs")
    keys = logs / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    metrics_port = free_port()
    stack = LocalStack(
        str(tiny_target), "ngram", drafters=1, gateway_listen=f"127.0.0.1:{free_port()}", log_dir=logs,
        verifier_args=("--page-size", "16", "--kv-budget-mb", kv_budget_mb(KV_PAGES),
                       "--max-context", "4096", "--prefill-chunk", "16", "--tree-budget", "8",
                       "--session-lease-s", str(LEASE_S), "--draft-timeout-s", str(DRAFT_TIMEOUT_S),
                       "--metrics-port", str(metrics_port)),
        gateway_args=("--api-keys-file", str(keys), "--verifier-keepalive-s", "1",
                      "--verifier-keepalive-timeout-s", "1", "--verifier-call-timeout-s", "3"))
    stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with stack:
        yield stack


@pytest.fixture(scope="module")
def reference(tiny_target):
    expected = greedy_reference(tiny_target, default_max_new=16, ignore_eos=True)
    return lambda prompt, max_new: expected(expected.encode(prompt) if isinstance(prompt, str) else prompt, max_new)


def client(stack: LocalStack, key: str = KEYS[0], timeout: float | None = 30) -> Client:
    return Client(stack.addresses["gateway"], api_key=key, timeout=timeout)


def settles(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def assert_kv_back_to_baseline(stack: LocalStack, timeout_s: float = 10.0) -> None:
    """No session left on the verifier and every page free (the lease is the slowest path back)."""
    def clean() -> bool:
        info = verifier_info(stack)
        return info.active_sessions == 0 and info.free_pages == KV_PAGES
    assert settles(clean, timeout_s), verifier_info(stack)


def expect_status(code: Code, call) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        result = call()
        if hasattr(result, "result"):
            result.result()
    assert caught.value.code() == code, caught.value
    return caught.value


def generate_ok(stack: LocalStack, reference, text: str, max_new: int = 16, key: str = KEYS[0]) -> None:
    generation = client(stack, key).generate(text, max_new_tokens=max_new, ignore_eos=True)
    generation.result()
    assert generation.token_ids == reference(text, max_new)


# ---- 2. no KV page ever leaks ------------------------------------------------------------------------------

def test_cancelled_prefills_leave_no_session(stack, reference) -> None:
    """Deadlines that expire mid-prefill (CreateSession and one-shot Generate) and a client that cancels one:
    every prefill's session is released, and later requests still get their pages."""
    for _ in range(3):
        expect_status(Code.DEADLINE_EXCEEDED, lambda: client(stack, timeout=0.4).create_session(
            token_ids=LONG_PROMPT))
        expect_status(Code.DEADLINE_EXCEEDED, lambda: client(stack, timeout=0.4).generate(
            token_ids=LONG_PROMPT, max_new_tokens=4))
        # NOTE: a one-shot Generate holds its session's quota from the start of its prefill; the gateway lets go
        # of it when its handler ends, which may come a moment after the client saw its deadline
        assert settles(lambda: not client(stack).list_sessions(), 5)
    generation = client(stack).generate(token_ids=LONG_PROMPT, max_new_tokens=4)
    threading.Timer(0.4, generation.cancel).start()
    expect_status(Code.CANCELLED, generation.result)
    assert_kv_back_to_baseline(stack)
    generate_ok(stack, reference, "after the cancelled prefills")


def test_cancelled_decode_releases_or_keeps_as_asked(stack) -> None:
    c = client(stack)
    for keep in (False, True):
        generation = c.generate("cancel me while I decode", max_new_tokens=2000, ignore_eos=True, keep_session=keep)
        next(iter(generation))
        generation.cancel()
        assert settles(lambda: not any(s.generating for s in c.list_sessions()), 5)
    (kept,) = c.list_sessions()
    assert 0 < kept.num_tokens < 2000
    c.release_session(kept.session)
    assert_kv_back_to_baseline(stack)


def test_a_gateway_killed_and_restarted_leaves_no_page_past_the_lease(stack, reference) -> None:
    c = client(stack)
    handles = [c.create_session(f"held by a gateway about to die #{i}").session.session for i in range(2)]
    generation = c.generate("a generation the gateway's death cuts short", max_new_tokens=3000, ignore_eos=True)
    next(iter(generation))
    assert verifier_info(stack).active_sessions == 3
    stack.kill("gateway")
    expect_status(Code.UNAVAILABLE, generation.result)
    stack.restart("gateway")
    expect_status(Code.NOT_FOUND, lambda: client(stack).get_session(handles[0]))  # the new gateway never had it
    assert_kv_back_to_baseline(stack, timeout_s=LEASE_S + 5)
    generate_ok(stack, reference, "the restarted gateway serves")


def test_verifier_metrics_show_sessions_and_pages_as_they_are(stack) -> None:
    c = client(stack)
    handle = c.create_session("counted while it lives").session.session
    text = urllib.request.urlopen(stack.metrics_url, timeout=5).read().decode()
    info = verifier_info(stack)
    assert f"ddtree_verifier_sessions {float(info.active_sessions)}" in text
    assert f"ddtree_verifier_kv_pages_free {float(info.free_pages)}" in text and info.free_pages < KV_PAGES
    c.release_session(handle)
    text = urllib.request.urlopen(stack.metrics_url, timeout=5).read().decode()
    assert f"ddtree_verifier_kv_pages_free {float(KV_PAGES)}" in text and "ddtree_verifier_sessions 0.0" in text


# ---- 3. bounded work per request ---------------------------------------------------------------------------

def test_oversized_and_malformed_input_is_refused_at_once(stack, reference) -> None:
    """A 7.5 MB prompt is refused by its bytes before any tokenization while another stream keeps its pace;
    text that is not UTF-8 is INVALID_ARGUMENT naming the field."""
    gaps: list[float] = []

    def stream() -> None:
        last = time.monotonic()
        for _ in client(stack, KEYS[1]).generate("a stream beside the abuse", max_new_tokens=60, ignore_eos=True):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    beside = threading.Thread(target=stream)
    beside.start()
    time.sleep(0.3)
    started = time.monotonic()
    error = expect_status(Code.INVALID_ARGUMENT, lambda: client(stack).generate("x" * 7_500_000, max_new_tokens=4))
    assert time.monotonic() - started < 2.0 and "text" in error.details() and "bytes" in error.details()
    beside.join(30)
    assert gaps and max(gaps[1:] or [0]) < 1.0, gaps

    with grpc.insecure_channel(stack.addresses["gateway"]) as channel:
        raw = channel.unary_stream("/ddtree.v1.Gateway/Generate", request_serializer=bytes,
                                   response_deserializer=gateway_pb2.GenerateReply.FromString)
        body = gateway_pb2.GenerateRequest(text="ok").SerializeToString().replace(b"ok", b"\xff\xfe")
        with pytest.raises(grpc.RpcError) as caught:
            list(raw(body, metadata=(("authorization", f"Bearer {KEYS[0]}"),), timeout=10))
    assert caught.value.code() == Code.INVALID_ARGUMENT and "text" in caught.value.details()
    assert_kv_back_to_baseline(stack)
    generate_ok(stack, reference, "still fine")


# ---- 4. a slow or hung drafter -----------------------------------------------------------------------------

def test_a_frozen_drafter_costs_one_timeout_and_a_restarted_one_is_used_again(stack, reference) -> None:
    text = "the drafter freezes under this one"
    stack.pause("drafter-0")
    try:
        started = time.monotonic()
        generate_ok(stack, reference, text, max_new=20)
        assert time.monotonic() - started < 3 * DRAFT_TIMEOUT_S + 2  # was one timeout per step (20 s)
    finally:
        stack.resume("drafter-0")
    stack.kill("drafter-0")
    generate_ok(stack, reference, text + " (drafter dead)", max_new=20)
    stack.restart("drafter-0")
    before = trees(stack)

    def drafts_again() -> bool:
        generate_ok(stack, reference, "the drafter is back", max_new=20)
        return trees(stack) > before
    assert settles(drafts_again, 15)
    assert_kv_back_to_baseline(stack)


def trees(stack: LocalStack) -> float:
    """Trees the verifier received, over every replica."""
    return verifier_metric(stack.metrics_url, "ddtree_verifier_trees")


# ---- 5. a frozen or dead verifier --------------------------------------------------------------------------

def test_a_frozen_verifier_is_unavailable_not_a_hang_and_recovers(stack, reference) -> None:
    # NOTE: deadlines far beyond what keepalive needs, so a regression fails the test instead of hanging it
    generation = client(stack, timeout=30).generate("the verifier freezes under this one", max_new_tokens=3000,
                                                    ignore_eos=True)
    next(iter(generation))
    stack.pause("verifier")
    try:
        started = time.monotonic()
        expect_status(Code.UNAVAILABLE, generation.result)  # keepalive: 1 s + 1 s
        assert time.monotonic() - started < 6
        time.sleep(2.5)  # the gateway's poll has marked it down: new sessions fail at once
        started = time.monotonic()
        expect_status(Code.UNAVAILABLE, lambda: client(stack, timeout=30).create_session("x"))
        assert time.monotonic() - started < 1
    finally:
        stack.resume("verifier")
    assert settles(lambda: client(stack).info().verifiers_up == 1, 5)
    assert_kv_back_to_baseline(stack)
    generate_ok(stack, reference, "the verifier thawed")


def test_a_verifier_killed_mid_stream_ends_it_with_a_status_then_comes_back(stack, reference) -> None:
    generation = client(stack).generate("the verifier dies under this one", max_new_tokens=3000, ignore_eos=True)
    chunks = [next(iter(generation))]
    stack.kill("verifier")
    error = expect_status(Code.UNAVAILABLE, generation.result)
    assert chunks and generation.summary is None
    assert "127.0.0.1" not in error.details() and "ipv4" not in error.details()
    stack.restart("verifier")
    assert settles(lambda: client(stack).info().verifiers_up == 1, 10)
    generate_ok(stack, reference, "a new verifier")
    assert_kv_back_to_baseline(stack)


# ---- 6. errors are statuses --------------------------------------------------------------------------------

def test_a_session_that_fills_the_context_stops_with_context_limit(stack, reference) -> None:
    prompt = [1 + i % 250 for i in range(4090)]
    generation = client(stack).generate(token_ids=prompt, max_new_tokens=50, ignore_eos=True)
    summary = generation.result()
    assert summary.stop_reason == common_pb2.STOP_REASON_CONTEXT_LIMIT and summary.session_tokens == 4096
    assert generation.token_ids == reference(prompt, 6)
    assert_kv_back_to_baseline(stack)


# ---- 7. fair shares ----------------------------------------------------------------------------------------

def test_one_key_exhausting_its_quota_spares_the_others(stack, reference) -> None:
    alice = client(stack, KEYS[0])
    held = []
    with pytest.raises(GatewayError) as caught:
        for _ in range(10):
            held.append(alice.create_session(token_ids=[7] * 1000).session.session)
    assert caught.value.code() == Code.RESOURCE_EXHAUSTED and "quota" in caught.value.details()
    assert len(held) == 4  # 4 x 1000 of alice's 4800 KV tokens
    generate_ok(stack, reference, "bob is not starved", key=KEYS[1])
    for handle in held:
        alice.release_session(handle)
    assert_kv_back_to_baseline(stack)
