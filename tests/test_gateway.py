"""The gateway over real gRPC on loopback, against a fake Verifier, through the real client and CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from ddtree.client import AsyncClient, Client, GatewayError
from ddtree.client_cli import add_client_commands
from gateway.auth import ApiKeys
from gateway.config import GatewayConfig
from gateway.server import RunningGateway, start
from gateway.text import OutputText
from modeling.tiny import byte_level_tokenizer
from modeling.tokenizer import TextStream, Tokenizer
from proto import common_pb2, verifier_pb2, verifier_pb2_grpc
from proto.serving import add_health_and_reflection, mark_serving
from proto.status import StatusError
from verifier_service.generation_stream import serve_generations

REPLY = "Hello, world! The END is near; more text follows. "
REPLY_IDS = list(REPLY.encode())  # the byte-level tokenizer: token id b is byte b
PAGE = 16
CAPACITY = 1000
MAX_MESSAGE = 64 << 10
Code = grpc.StatusCode


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Sessions of token lists; each Generate emits REPLY's bytes, 1, 2, 3, 1, ... per step, stopping at
    max_new_tokens or a stop string like the real engine. Records cancellations and deadlines."""

    def __init__(self) -> None:
        self.sessions: dict[str, list[int]] = {}
        self.generating: set[str] = set()
        self.cancelled: list[str] = []
        self.deadlines: list[float | None] = []
        self.fail_next: dict[str, Code] = {}
        self.fail_mid_stream = False
        self.step_delay_s = 0.0
        self.create_delay_s = 0.0
        self.reserved_pages = 0
        self.waiting = 0  # requests waiting for KV pages, as Info reports them
        self.renewed: list[str] = []
        self._ids = 0

    async def _maybe_fail(self, method: str, context: grpc.aio.ServicerContext) -> None:
        code = self.fail_next.pop(method, None)
        if code is not None:
            await context.abort(code, f"fake {method} failure")

    def _new(self, tokens: list[int]) -> verifier_pb2.VerifierSessionInfo:
        self._ids += 1
        session_id = f"v-{self._ids}"
        self.sessions[session_id] = tokens
        return self._info(session_id)

    def _info(self, session_id: str) -> verifier_pb2.VerifierSessionInfo:
        n = len(self.sessions[session_id])
        return verifier_pb2.VerifierSessionInfo(session_id=session_id, num_tokens=n, prefix_length=n - 1,
                                                pages_used=math.ceil(n / PAGE),
                                                generating=session_id in self.generating)

    async def _session(self, session_id: str, context: grpc.aio.ServicerContext) -> list[int]:
        if session_id not in self.sessions:
            await context.abort(Code.NOT_FOUND, "session_id: unknown")
        return self.sessions[session_id]

    async def CreateSession(self, request, context):
        await self._maybe_fail("CreateSession", context)
        await asyncio.sleep(self.create_delay_s)
        return verifier_pb2.VerifierCreateSessionReply(session=self._new(list(request.prompt_token_ids)),
                                                       prefill_ms=1.0)

    async def ForkSession(self, request, context):
        return self._new(list(await self._session(request.session_id, context)))

    async def ReleaseSession(self, request, context):
        tokens = await self._session(request.session_id, context)
        del self.sessions[request.session_id]
        return verifier_pb2.VerifierReleaseSessionReply(pages_freed=math.ceil(len(tokens) / PAGE))

    async def GetSession(self, request, context):
        await self._session(request.session_id, context)
        return self._info(request.session_id)

    async def RenewLeases(self, request, context):
        self.renewed.extend(request.session_ids)
        return verifier_pb2.VerifierRenewLeasesReply(
            unknown_session_ids=[sid for sid in request.session_ids if sid not in self.sessions])

    async def Info(self, request, context):
        used = sum(math.ceil(len(t) / PAGE) for t in self.sessions.values()) + self.reserved_pages
        return verifier_pb2.VerifierInfoReply(model_name="fake", page_size=PAGE, kv_capacity_pages=CAPACITY,
                                              free_pages=CAPACITY - used, max_context=4096, vocab_size=320,
                                              eos_token_ids=[256], active_sessions=len(self.sessions),
                                              room_pages=CAPACITY - used, waiting_requests=self.waiting)

    async def GenerateStream(self, request_iterator, context):
        def generation(message: verifier_pb2.VerifierStreamRequest, slot):
            return self.Generate(message.generate, StreamedContext(message.timeout_s))
        async for reply in serve_generations(request_iterator, generation, ()):
            yield reply

    async def Generate(self, request, context):
        await self._maybe_fail("Generate", context)
        self.deadlines.append(context.time_remaining())
        session_id, params = request.session_id, request.params
        tokens = await self._session(session_id, context)
        tokens.extend(request.append_token_ids)
        self.generating.add(session_id)
        out: list[int] = []
        try:
            for step in range(params.max_new_tokens):
                proposed = [REPLY_IDS[(len(out) + i) % len(REPLY_IDS)] for i in range(1 + step % 3)]
                emitted, reason = [], common_pb2.STOP_REASON_UNSPECIFIED
                for token in proposed:
                    emitted.append(token)
                    out.append(token)
                    if any(s in bytes(out).decode() for s in params.stop_strings):
                        reason = common_pb2.STOP_REASON_STOP_STRING
                    elif len(out) >= params.max_new_tokens:
                        reason = common_pb2.STOP_REASON_LENGTH
                    if reason:
                        break
                tokens.extend(emitted)
                if self.fail_mid_stream and step == 2:
                    await context.abort(Code.UNAVAILABLE, "fake verifier lost its GPU")
                yield verifier_pb2.VerifierGenerateStep(
                    step=step, token_ids=emitted, acceptance_length=len(proposed), drafted_nodes=4,
                    finished=bool(reason), stop_reason=reason, num_tokens=len(tokens))
                if reason:
                    return
                await asyncio.sleep(self.step_delay_s)
        except asyncio.CancelledError:
            self.cancelled.append(session_id)
            raise
        finally:
            self.generating.discard(session_id)
            if not request.keep_session:
                self.sessions.pop(session_id, None)


class _Aborted(StatusError):
    def __init__(self, code: Code, details: str) -> None:
        super().__init__(details)
        self.code = code


class StreamedContext:
    """What FakeVerifier.Generate uses of its context, for a generation of a GenerateStream call."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s or None

    def time_remaining(self) -> float | None:
        return self.timeout_s

    async def abort(self, code: Code, details: str) -> None:
        raise _Aborted(code, details)


class Stack:
    """An event loop in a thread serving the fakes and gateways, so blocking clients can call them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[grpc.aio.Server] = []
        self.gateways: list[RunningGateway] = []

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def fake(self) -> tuple[FakeVerifier, str]:
        async def serve() -> tuple[FakeVerifier, str]:
            fake, server = FakeVerifier(), grpc.aio.server()
            verifier_pb2_grpc.add_VerifierServicer_to_server(fake, server)
            fake.health = add_health_and_reflection(server, [])
            await mark_serving(fake.health, [])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            return fake, f"127.0.0.1:{port}"
        return self.run(serve())

    def gateway(self, keys: tuple[str, ...] = (), **config: Any) -> RunningGateway:
        gateway = self.run(start(GatewayConfig(listen="127.0.0.1:0", **config), ApiKeys(keys)))
        self.gateways.append(gateway)
        return gateway

    def close(self) -> None:
        for gateway in self.gateways:
            self.run(gateway.stop(0))
        for server in self.servers:
            self.run(server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    byte_level_tokenizer().save(str(tokenizer_dir / "tokenizer.json"))
    stack = Stack()
    (fake_a, addr_a), (fake_b, addr_b) = stack.fake(), stack.fake()
    common = dict(tokenizer_dir=str(tokenizer_dir), housekeeping_interval_s=0.1, max_message_bytes=MAX_MESSAGE)
    metrics_port = _free_port()
    ns = argparse.Namespace(
        stack=stack, fakes=(fake_a, fake_b), tokenizer_dir=tokenizer_dir, metrics_port=metrics_port,
        # two verifiers, no auth, metrics on
        plain=stack.gateway(verifiers=(addr_a, addr_b), metrics_port=metrics_port, **common),
        # one verifier (fake_a), keys on, the HTTP API on
        keyed=stack.gateway(keys=("k-alice", "k-bob"), verifiers=(addr_a,), http_listen="127.0.0.1:0", **common),
        # one verifier (fake_b), sessions expire fast
        short=stack.gateway(verifiers=(addr_b,), session_idle_ttl_s=0.4, **common),
        # one verifier (fake_b), no auth, quotas per client address, a quarter of the KV each, short prompts
        by_peer=stack.gateway(verifiers=(addr_b,), quota_by="peer", kv_share_per_key=0.25, max_prompt_bytes=1000,
                              **common),
    )
    yield ns
    stack.close()


def client(gateway: RunningGateway, **options: Any) -> Client:
    return Client(f"127.0.0.1:{gateway.port}", **options)


def wait_for(condition: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def expect_error(code: Code, call: Callable[[], Any], *fragments: str) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        result = call()
        if hasattr(result, "result"):
            result.result()
    assert caught.value.code() == code, caught.value
    for fragment in fragments:
        assert fragment in caught.value.details()
    return caught.value


def test_generate_streams_chunks_and_a_summary(env) -> None:
    with client(env.plain) as c:
        generation = c.generate("Hi", max_new_tokens=10)
        chunks = list(generation)
        summary = generation.summary
        assert [list(ch.token_ids) for ch in chunks] == [REPLY_IDS[0:1], REPLY_IDS[1:3], REPLY_IDS[3:6],
                                                         REPLY_IDS[6:7], REPLY_IDS[7:9], REPLY_IDS[9:10]]
        assert "".join(ch.text for ch in chunks) == REPLY[:10] == generation.text
        assert [ch.acceptance_length for ch in chunks] == [1, 2, 3, 1, 2, 3]
        assert summary.stop_reason == common_pb2.STOP_REASON_LENGTH and summary.session == ""
        assert (summary.prompt_tokens, summary.generated_tokens, summary.steps) == (2, 10, 6)
        assert summary.session_tokens == 12
        assert summary.mean_acceptance_length == pytest.approx(2.0)
        assert 0 < summary.ttft_ms <= summary.e2e_ms
        assert c.list_sessions() == []  # the one-shot session is gone from the gateway and the verifiers
    assert all(not fake.sessions for fake in env.fakes)


def test_sessions_create_continue_fork_release_list(env) -> None:
    with client(env.plain) as c:
        created = c.create_session("abc")
        handle = created.session.session
        assert created.session.num_tokens == 3 and created.prefill_ms > 0
        summary = c.generate("de", session=handle, max_new_tokens=4).result()
        assert summary.session == handle and summary.prompt_tokens == 2 and summary.session_tokens == 3 + 2 + 4
        fork = c.fork_session(handle)
        assert fork.session != handle and fork.num_tokens == 9
        c.generate("", session=fork.session, max_new_tokens=3).result()
        assert (c.get_session(handle).num_tokens, c.get_session(fork.session).num_tokens) == (9, 12)
        assert {s.session for s in c.list_sessions()} == {handle, fork.session}
        one_shot = c.generate("xyz", max_new_tokens=2, keep_session=True).result()
        assert one_shot.session and c.get_session(one_shot.session).num_tokens == 5
        for h in (handle, fork.session, one_shot.session):
            c.release_session(h)
        assert c.list_sessions() == []
        expect_error(Code.NOT_FOUND, lambda: c.get_session(handle), "session")
    assert all(not fake.sessions for fake in env.fakes)


def test_new_sessions_go_to_the_verifier_with_no_queue_and_most_room(env) -> None:
    fake_a, fake_b = env.fakes
    fake_a.reserved_pages = 500
    env.stack.run(env.plain.service.refresh())
    with client(env.plain) as c:
        handles = [c.create_session("x").session.session for _ in range(3)]
        assert len(fake_b.sessions) == 3 and not fake_a.sessions
        for h in handles:
            c.release_session(h)
    fake_b.waiting = 1  # requests wait for pages there: the one with less room but no queue gets the next
    env.stack.run(env.plain.service.refresh())
    with client(env.plain) as c:
        handle = c.create_session("x").session.session
        assert len(fake_a.sessions) == 1 and not fake_b.sessions
        c.release_session(handle)
    fake_a.reserved_pages, fake_b.waiting = 0, 0
    env.stack.run(env.plain.service.refresh())
    with client(env.plain) as c:  # equal free pages: in turn
        handles = [c.create_session("x").session.session for _ in range(2)]
        assert len(fake_a.sessions) == len(fake_b.sessions) == 1
        for h in handles:
            c.release_session(h)


def test_api_keys_and_handles_bound_to_them(env) -> None:
    expect_error(Code.UNAUTHENTICATED, lambda: client(env.keyed).info(), "authorization")
    expect_error(Code.UNAUTHENTICATED, lambda: client(env.keyed, api_key="k-mallory").info(), "unknown API key")
    with client(env.keyed, api_key="k-alice") as alice, client(env.keyed, api_key="k-bob") as bob:
        assert alice.info().auth_required
        first, second = (alice.create_session("abc").session.session for _ in range(2))
        assert first != second and len(first) >= 32 and "v-" not in first
        for call in (lambda: bob.get_session(first), lambda: bob.fork_session(first),
                     lambda: bob.release_session(first), lambda: bob.generate("x", session=first)):
            expect_error(Code.PERMISSION_DENIED, call, "another API key")
        assert bob.list_sessions() == []
        assert {s.session for s in alice.list_sessions()} == {first, second}
        expect_error(Code.UNAUTHENTICATED, lambda: client(env.keyed).generate("x", session=first))
        for h in (first, second):
            alice.release_session(h)


def test_unknown_and_expired_handles_are_not_found(env) -> None:
    fake_b = env.fakes[1]
    with client(env.short) as c:
        expect_error(Code.NOT_FOUND, lambda: c.get_session("no-such-handle"), "session")
        expect_error(Code.NOT_FOUND, lambda: c.generate("x", session="no-such-handle"), "session")
        handle = c.create_session("abc").session.session
        assert c.get_session(handle).expires_in_s > 0
        assert wait_for(lambda: not fake_b.sessions)  # housekeeping released it at the verifier
        expect_error(Code.NOT_FOUND, lambda: c.get_session(handle), "expired")


@pytest.mark.parametrize("call, field", [
    (lambda c: c.generate(""), "text"),
    (lambda c: c.create_session(""), "text"),
    (lambda c: c.create_session("a", token_ids=[97]), "token_ids"),
    (lambda c: c.create_session(token_ids=[97, -1]), "token_ids"),
    (lambda c: c.create_session(token_ids=[97, 10_000]), "token_ids"),
    (lambda c: c.generate("a", temperature=-1.0), "params.temperature"),
    (lambda c: c.generate("a", temperature=float("nan")), "params.temperature"),
    (lambda c: c.generate("a", temperature=1e9), "params.temperature"),
    (lambda c: c.generate("a", top_p=1.5), "params.top_p"),
    (lambda c: c.generate("a", top_k=-3), "params.top_k"),
    (lambda c: c.generate("a", repetition_penalty=0.0), "params.repetition_penalty: must be > 0"),
    (lambda c: c.generate("a", repetition_penalty=float("inf")), "params.repetition_penalty"),
    (lambda c: c.generate("a", presence_penalty=2.5), "params.presence_penalty"),
    (lambda c: c.generate("a", frequency_penalty=-2.5), "params.frequency_penalty"),
    (lambda c: c.generate("a", logit_bias={10_000: 1.0}), "params.logit_bias: token 10000 is outside the vocabulary"),
    (lambda c: c.generate("a", logit_bias={-1: 1.0}), "params.logit_bias: token -1 is outside the vocabulary"),
    (lambda c: c.generate("a", logit_bias={5: 101.0}), "params.logit_bias: token 5's bias"),
    (lambda c: c.generate("a", logit_bias=dict.fromkeys(range(301), 1.0)), "params.logit_bias: 301 tokens"),
    (lambda c: c.generate("a", max_new_tokens=-1), "params.max_new_tokens"),
    (lambda c: c.generate("a", max_new_tokens=10**7), "params.max_new_tokens"),
    (lambda c: c.generate("a", stop=[""]), "params.stop_strings"),
    (lambda c: c.generate("a", stop_token_ids=[-5]), "params.stop_token_ids"),
    (lambda c: c.generate("a", logprobs=21), "params.logprobs"),
    (lambda c: c.generate("a", logprobs=-1), "params.logprobs"),
    (lambda c: c.create_session(token_ids=[1] * 5000), "context"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(env, call, field: str) -> None:
    with client(env.plain) as c:
        expect_error(Code.INVALID_ARGUMENT, lambda: call(c), field)


def test_oversized_message_is_resource_exhausted(env) -> None:
    with client(env.plain) as c:
        expect_error(Code.RESOURCE_EXHAUSTED, lambda: c.create_session("x" * (MAX_MESSAGE + 1)))


def test_verifier_status_passes_through(env) -> None:
    fake_a = env.fakes[0]
    with client(env.keyed, api_key="k-alice") as c:
        fake_a.fail_next["CreateSession"] = Code.RESOURCE_EXHAUSTED
        expect_error(Code.RESOURCE_EXHAUSTED, lambda: c.create_session("abc"), "fake CreateSession failure")
        fake_a.fail_next["CreateSession"] = Code.RESOURCE_EXHAUSTED
        expect_error(Code.RESOURCE_EXHAUSTED, lambda: c.generate("abc"))
        fake_a.fail_next["Generate"] = Code.RESOURCE_EXHAUSTED
        expect_error(Code.RESOURCE_EXHAUSTED, lambda: c.generate("abc"), "fake Generate failure")
        assert c.list_sessions() == [] and not fake_a.sessions  # the failed one-shot was released


def test_failure_mid_stream_ends_the_stream_with_its_status(env) -> None:
    """The chunks sent before the failure stand; the call ends UNAVAILABLE (not OK with an error summary), and
    the message names no verifier address or session."""
    fake_a = env.fakes[0]
    fake_a.fail_mid_stream = True
    try:
        with client(env.keyed, api_key="k-alice") as c:
            generation = c.generate("abc", max_new_tokens=50)
            error = expect_error(Code.UNAVAILABLE, generation.result, "retry")
    finally:
        fake_a.fail_mid_stream = False
    assert generation.token_ids == REPLY_IDS[:3] and generation.summary is None
    assert "GPU" not in error.details() and "127.0.0.1" not in error.details()
    assert wait_for(lambda: not fake_a.sessions)  # the one-shot session is released


def test_cancelled_client_cancels_the_verifier_stream(env) -> None:
    fake_a = env.fakes[0]

    async def cancel_after_two_chunks() -> None:
        async with AsyncClient(f"127.0.0.1:{env.keyed.port}", api_key="k-alice") as c:
            generation = c.generate("abc", max_new_tokens=5000)
            seen = 0
            async for _ in generation:
                seen += 1
                if seen == 2:
                    generation.cancel()
                    break

    fake_a.step_delay_s = 0.05
    try:
        asyncio.run(cancel_after_two_chunks())
        assert wait_for(lambda: len(fake_a.cancelled) == 1)
    finally:
        fake_a.step_delay_s = 0.0
    assert wait_for(lambda: not fake_a.sessions)
    with client(env.keyed, api_key="k-alice") as c:
        assert c.list_sessions() == []


def test_stop_string_is_cut_from_the_text(env) -> None:
    with client(env.plain) as c:
        generation = c.generate("Hi", max_new_tokens=100, stop=["END"])
        summary = generation.result()
    assert summary.stop_reason == common_pb2.STOP_REASON_STOP_STRING
    assert generation.text == REPLY[: REPLY.index("END")]
    assert generation.token_ids == REPLY_IDS[: REPLY.index("END") + 3]


def test_output_text_holds_back_possible_stop_strings(env) -> None:
    text = OutputText(Tokenizer.from_dir(env.tokenizer_dir), ["<stop>"])
    deltas = [text.push(list(piece.encode())) for piece in ("ab<", "st", "x<s", "to", "p>tail")]
    assert deltas == ["ab", "", "<stx", "", ""]
    flushed = OutputText(Tokenizer.from_dir(env.tokenizer_dir), ["<stop>"])
    assert [flushed.push(list(b"a<st")), flushed.push(list(b"o"), final=True)] == ["a", "<sto"]


def test_deadline_is_passed_downstream(env) -> None:
    fake_a = env.fakes[0]
    with client(env.keyed, api_key="k-alice") as c:
        c.generate("abc", max_new_tokens=3).result()
    assert fake_a.deadlines[-1] is None
    with client(env.keyed, api_key="k-alice", timeout=7.0) as c:
        c.generate("abc", max_new_tokens=3).result()
    assert fake_a.deadlines[-1] is not None and 6.0 < fake_a.deadlines[-1] < 7.1  # grpc rounds deadlines


def test_info_and_models(env) -> None:
    with client(env.plain) as c:
        info = c.info()
        assert (info.verifiers, info.verifiers_up, info.auth_required) == (2, 2, False)
        assert info.model.name == "fake" and info.model.max_context == 4096
        assert info.default_max_new_tokens == GatewayConfig.default_max_new_tokens
        assert [m.name for m in c.list_models()] == ["fake"]


def test_health_and_reflection(env) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{env.plain.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "ddtree.v1.Gateway"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"ddtree.v1.Gateway", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def test_metrics_endpoint(env) -> None:
    with client(env.plain) as c:
        c.generate("Hi", max_new_tokens=5).result()
        expect_error(Code.INVALID_ARGUMENT, lambda: c.generate(""))
    env.stack.run(env.plain.service.refresh())
    body = urllib.request.urlopen(f"http://127.0.0.1:{env.metrics_port}/metrics", timeout=5).read().decode()
    for name in ("ddtree_gateway_ttft_seconds_bucket", "ddtree_gateway_inter_token_latency_seconds_bucket",
                 "ddtree_gateway_e2e_latency_seconds_count", "ddtree_gateway_acceptance_length_bucket",
                 "ddtree_gateway_drafted_tokens_total", "ddtree_gateway_accepted_tokens_total",
                 "ddtree_gateway_kv_pages_used", "ddtree_gateway_kv_pages_free", "ddtree_gateway_active_sessions",
                 'ddtree_gateway_errors_total{code="INVALID_ARGUMENT"}'):
        assert name in body, name


def _cli(*argv: str) -> None:
    parser = argparse.ArgumentParser()
    add_client_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.run(args)


def test_cli_generate_and_sessions(env, capsys: pytest.CaptureFixture[str]) -> None:
    gateway = ("--gateway", f"127.0.0.1:{env.plain.port}")
    _cli("generate", "Hi", "--max-new-tokens", "6", *gateway)
    assert capsys.readouterr().out == REPLY[:6] + "\n"
    _cli("generate", "Hi", "--max-new-tokens", "30", "--stop", "END", "--json", *gateway)
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == REPLY[: REPLY.index("END")] and out["stop_reason"] == "stop_string"
    assert out["acceptance_lengths"][:3] == [1, 2, 3] and out["timings"]["ttft_ms"] > 0
    _cli("session", "create", "abc", *gateway)
    handle = capsys.readouterr().out.strip()
    _cli("session", "fork", handle, *gateway)
    fork = capsys.readouterr().out.strip()
    _cli("session", "get", fork, *gateway)
    assert json.loads(capsys.readouterr().out)["num_tokens"] == 3
    _cli("session", "list", *gateway)
    assert {json.loads(line)["session"] for line in capsys.readouterr().out.splitlines()} == {handle, fork}
    for h in (handle, fork):
        _cli("session", "release", h, *gateway)
    with pytest.raises(SystemExit) as exit_info:
        _cli("session", "get", handle, *gateway)
    assert exit_info.value.code == 1 and "NOT_FOUND" in capsys.readouterr().err


def test_gateway_and_client_import_no_torch() -> None:
    code = ("import sys, gateway.server, gateway.servicer, ddtree.client, ddtree.client_cli, ddtree.chat, ddtree.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_leases_are_renewed_and_handles_the_verifier_lost_are_dropped(env) -> None:
    fake_b = env.fakes[1]
    with client(env.by_peer) as c:
        kept, lost = (c.create_session("abc").session.session for _ in range(2))
        env.stack.run(env.by_peer.service.refresh())
        held = set(fake_b.sessions)
        assert held <= set(fake_b.renewed)
        lost_id = env.by_peer.service.registry.peek(lost, None).verifier_session_id
        del fake_b.sessions[lost_id]  # as after a verifier restart, or a lease that ran out there
        env.stack.run(env.by_peer.service.refresh())
        expect_error(Code.NOT_FOUND, lambda: c.get_session(lost), "session")
        assert c.get_session(kept).num_tokens == 3
        c.release_session(kept)


def test_kv_quota_per_key_spares_the_other_keys(env) -> None:
    """fake_a holds 16000 KV tokens; a key may hold half: prompts, appended text and max_new_tokens count."""
    with client(env.keyed, api_key="k-alice") as alice, client(env.keyed, api_key="k-bob") as bob:
        first = alice.create_session(token_ids=[97] * 3000).session.session
        second = alice.create_session(token_ids=[97] * 3000).session.session
        expect_error(Code.RESOURCE_EXHAUSTED, lambda: alice.create_session(token_ids=[97] * 3000), "kv quota")
        expect_error(Code.RESOURCE_EXHAUSTED, lambda: alice.generate("x", session=first, max_new_tokens=2500),
                     "kv quota")
        expect_error(Code.RESOURCE_EXHAUSTED, lambda: alice.fork_session(first), "kv quota")
        other = bob.create_session(token_ids=[97] * 3000).session.session  # bob's share is untouched
        alice.generate("x", session=first, max_new_tokens=100).result()
        for handle, owner in ((first, alice), (second, alice), (other, bob)):
            owner.release_session(handle)
        alice.create_session(token_ids=[97] * 3000)  # room again
        for info in alice.list_sessions():
            alice.release_session(info.session)


def test_quotas_by_peer_apply_without_keys(env) -> None:
    with client(env.by_peer) as c:
        handle = c.create_session(token_ids=[97] * 3000).session.session  # a quarter of 16000 is 4000
        expect_error(Code.RESOURCE_EXHAUSTED, lambda: c.create_session(token_ids=[97] * 3000), "kv quota")
        c.release_session(handle)


def test_oversized_text_is_refused_by_its_bytes(env) -> None:
    with client(env.by_peer) as c:
        expect_error(Code.INVALID_ARGUMENT, lambda: c.create_session("é" * 501), "text", "1002 bytes")
        c.release_session(c.create_session("x" * 1000).session.session)


def test_verifier_internals_never_reach_the_client(env) -> None:
    fake_a = env.fakes[0]
    with client(env.keyed, api_key="k-alice") as c:
        for code, fragment in ((Code.UNAVAILABLE, "retry"), (Code.INTERNAL, "INTERNAL"),
                               (Code.NOT_FOUND, "session")):
            fake_a.fail_next["CreateSession"] = code
            error = expect_error(code, lambda: c.create_session("abc"), fragment)
            assert "fake" not in error.details()


def test_text_stream_decodes_incrementally_and_exactly(env) -> None:
    tokenizer = Tokenizer.from_dir(env.tokenizer_dir)
    text = "héllo wörld, 日本語 and more " * 40
    decoded_lengths: list[int] = []
    decode = tokenizer.decode
    tokenizer.decode = lambda ids: decoded_lengths.append(len(ids)) or decode(ids)
    stream = TextStream(tokenizer)
    deltas = [stream.push([b]) for b in text.encode()]
    assert "".join(deltas) == text
    assert max(decoded_lengths) <= 2 * TextStream.CONTEXT_TOKENS + 4  # not the whole output each time
    cut = list("日本".encode())[:4]  # the end of a generation can cut a character short
    for pushes in ([cut[:2], cut[2:]], [cut[:3], cut[3:]], [cut]):
        stream = TextStream(tokenizer)
        deltas = [stream.push(ids, final=i == len(pushes) - 1) for i, ids in enumerate(pushes)]
        assert "".join(deltas) == decode(cut)


def test_new_sessions_avoid_a_verifier_that_is_not_serving(env) -> None:
    fake_a, fake_b = env.fakes
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    env.stack.run(fake_a.health.set("", not_serving))
    env.stack.run(env.plain.service.refresh())
    try:
        with client(env.plain) as c:
            handles = [c.create_session("x").session.session for _ in range(3)]
            assert len(fake_b.sessions) == 3 and not fake_a.sessions
            for handle in handles:
                c.release_session(handle)
            env.stack.run(fake_b.health.set("", not_serving))
            env.stack.run(env.plain.service.refresh())
            started = time.monotonic()
            expect_error(Code.UNAVAILABLE, lambda: c.create_session("x"), "retry")
            assert time.monotonic() - started < 1.0
    finally:
        for fake in env.fakes:
            env.stack.run(fake.health.set("", health_pb2.HealthCheckResponse.SERVING))
        env.stack.run(env.plain.service.refresh())


def test_chat_without_a_chat_template_is_invalid_argument_over_grpc_and_http(env) -> None:
    assert wait_for(lambda: env.keyed.service.pool.up)  # after a test that took its verifier out of service
    with client(env.keyed, api_key="k-alice") as c:
        expect_error(Code.INVALID_ARGUMENT, lambda: c.chat([{"role": "user", "content": "hi"}]), "messages: ",
                     "no chat template")
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{env.keyed.http_port}/v1", api_key="k-alice", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        http.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["param"] == "messages" and "no chat template" in caught.value.body["message"]


def test_a_failure_after_the_first_chunk_is_the_http_streams_last_event(env) -> None:
    """As over gRPC: the text before it stands, and the message names no verifier internals."""
    fake_a = env.fakes[0]
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{env.keyed.http_port}/v1", api_key="k-alice", max_retries=0)
    fake_a.fail_mid_stream = True
    try:
        stream = http.completions.create(model="fake", prompt="abc", max_tokens=50, stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="retry") as caught:
            for chunk in stream:
                texts.append(chunk.choices[0].text)
        with pytest.raises(openai.APIStatusError) as unary:
            http.completions.create(model="fake", prompt="abc", max_tokens=50)
    finally:
        fake_a.fail_mid_stream = False
    assert "".join(texts) == REPLY[:3] and "GPU" not in str(caught.value)
    assert unary.value.status_code == 503 and unary.value.body["type"] == "service_unavailable_error"
    assert wait_for(lambda: not fake_a.sessions)


def http_events(gateway: RunningGateway, route: str, body: dict) -> list[Any]:
    """A streamed HTTP request's server-sent events, raw: each JSON payload, or the string "[DONE]"."""
    request = urllib.request.Request(f"http://127.0.0.1:{gateway.http_port}/v1/{route}", method="POST",
                                     data=json.dumps(body).encode(), headers={"Authorization": "Bearer k-alice"})
    with urllib.request.urlopen(request, timeout=10) as response:
        payloads = [e.removeprefix("data: ") for e in response.read().decode().split("\n\n") if e]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_choice_ends_every_choice_and_releases_every_fork(env, stream: bool) -> None:
    """One of n choices fails (the verifier refuses its generation): the others are cancelled, the failure is the
    reply's status, or a stream's one last event, and neither a fork nor the prompt's session stays."""
    fake_a = env.fakes[0]
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{env.keyed.http_port}/v1", api_key="k-alice", max_retries=0)
    cancelled = len(fake_a.cancelled)
    # NOTE: the other choices are still generating when one fails, and their first tokens are out before its failure
    # reaches the reply (it releases its fork first): a stream's error is its last event
    fake_a.step_delay_s = 0.01
    fake_a.fail_next["Generate"] = Code.UNAVAILABLE
    try:
        if stream:
            events = http_events(env.keyed, "completions", {"prompt": "abc", "max_tokens": 50, "n": 3, "stream": True})
            assert "[DONE]" not in events and [e for e in events if "error" in e] == [events[-1]]
            assert events[-1]["error"]["code"] == "unavailable"
        else:
            with pytest.raises(openai.APIStatusError) as caught:
                http.completions.create(model="fake", prompt="abc", max_tokens=50, n=3)
            assert caught.value.status_code == 503
    finally:
        fake_a.step_delay_s = 0.0
    assert wait_for(lambda: not fake_a.sessions and len(fake_a.cancelled) == cancelled + 2)
    assert not env.keyed.service.registry.on_verifier(env.keyed.service.pool.addresses[0])


def test_choices_time_their_first_token_from_the_requests_arrival(env) -> None:
    """n choices wait for the prompt's one prefill (CreateSession, 0.3 s here) before their forks generate: each
    choice's time to first token counts it, as one choice's does."""
    fake_a = env.fakes[0]
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{env.keyed.http_port}/v1", api_key="k-alice", max_retries=0)
    ttft = env.keyed.service.metrics.ttft

    def observed() -> tuple[float, float]:
        samples = {s.name: s.value for metric in ttft.collect() for s in metric.samples}
        return samples["ddtree_gateway_ttft_seconds_count"], samples["ddtree_gateway_ttft_seconds_sum"]

    count, total = observed()
    fake_a.create_delay_s = 0.3
    try:
        http.completions.create(model="fake", prompt="abc", max_tokens=5, n=2)
    finally:
        fake_a.create_delay_s = 0.0
    after_count, after_total = observed()
    assert after_count == count + 2 and after_total - total >= 2 * 0.3


def test_choices_count_each_fork_against_the_kv_quota(env) -> None:
    """A fork counts the prompt's whole length (docs/limits.md): a 2500-token prompt and 3 choices of 200 tokens
    ask for 4 x 2500 + 3 x 200 of alice's 8000 KV tokens, too many; 2 choices for 3 x 2500 + 2 x 200."""
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{env.keyed.http_port}/v1", api_key="k-alice", max_retries=0)
    prompt = [97] * 2500
    two = http.completions.create(model="fake", prompt=prompt, max_tokens=200, n=2)
    assert [c.text for c in two.choices] == [(REPLY * 4)[:200]] * 2 and two.usage.completion_tokens == 400
    with pytest.raises(openai.RateLimitError) as caught:
        http.completions.create(model="fake", prompt=prompt, max_tokens=200, n=3)
    assert caught.value.body["message"].startswith("kv quota: ")
    assert wait_for(lambda: not env.fakes[0].sessions)


def test_an_http_body_over_the_message_limit_is_413_in_openais_shape(env) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{env.keyed.http_port}/v1/completions",
                                     data=json.dumps({"prompt": "x" * MAX_MESSAGE}).encode(), method="POST",
                                     headers={"Authorization": "Bearer k-alice"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 413
    assert set(json.loads(caught.value.read())["error"]) == {"message", "type", "param", "code"}
