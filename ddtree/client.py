"""Python client of the ddtree-serve gateway: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("localhost:50051") as client:
        generation = client.generate("Once upon a time", max_new_tokens=64)
        for chunk in generation:
            print(chunk.text, end="", flush=True)
        print(generation.summary.tokens_per_second)

Chunks and summaries are the gateway's protobuf messages (GenerateChunk, GenerateSummary); `generation.events()`
also yields the PrefillProgress of a long prompt before the first chunk. Failures
raise GatewayError, a grpc.RpcError keeping the status code and details (after a failed TLS handshake, led by
what was wrong with the certificate). With `tls=Tls(ca="ca.crt")` the client dials with TLS, trusting that root
certificate (`Tls()`: the system's roots); `cert` and `key` are a client certificate, for a gateway that
requires one. No torch here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import grpc

from proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from proto.security import Tls, client_channel, tls_failure_hint

DEFAULT_GATEWAY = "localhost:50051"
MAX_MESSAGE_BYTES = 64 << 20


class GatewayError(grpc.RpcError):
    """A failed gateway call: `code()` and `details()` as on any grpc.RpcError."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _gateway_error(error: grpc.RpcError) -> GatewayError:
    details = error.details() or ""
    hint = tls_failure_hint(details) if error.code() == grpc.StatusCode.UNAVAILABLE else None
    return GatewayError(error.code(), f"{hint} ({details})" if hint else details)


def sampling_params(max_new_tokens: int = 0, temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0,
                    seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                    ignore_eos: bool = False, logprobs: int | None = None,
                    repetition_penalty: float | None = None, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0, logit_bias: Mapping[int, float] | None = None
                    ) -> common_pb2.SamplingParams:
    """0 means "the server's default" for max_new_tokens, and "off" for top_k and top_p. `logprobs`: each token's
    log-probability and this many alternatives in the chunks (None: none). The penalties and `logit_bias` (token id
    -> bias) as in proto/common.proto; repetition_penalty None: off."""
    params = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                       max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                       stop_strings=stop, ignore_eos=ignore_eos, logprobs=logprobs,
                                       repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                       frequency_penalty=frequency_penalty, logit_bias=logit_bias)
    if seed is not None:
        params.seed = seed
    return params


def generate_request(text: str = "", *, token_ids: Sequence[int] = (), session: str | None = None,
                     keep_session: bool = False, tree_budget: int = 0, prompt_logprobs: int | None = None,
                     **params) -> gateway_pb2.GenerateRequest:
    """`params` as in `sampling_params`; `tree_budget` pins the draft tree per step (0: the server's policy);
    `prompt_logprobs`: the prompt's logprobs with that many alternatives (the generation's `prompt`)."""
    return gateway_pb2.GenerateRequest(text=text, token_ids=token_ids, session=session or "",
                                       params=sampling_params(**params), keep_session=keep_session,
                                       tree_budget=tree_budget, prompt_logprobs=prompt_logprobs)


def chat_request(messages: Sequence[Mapping[str, str]], *, session: str | None = None, keep_session: bool = False,
                 tree_budget: int = 0, **params) -> gateway_pb2.ChatRequest:
    """`messages` as {"role": ..., "content": ...}; `params` as in `sampling_params`, `tree_budget` as in
    `generate_request`."""
    return gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role=m["role"], content=m["content"])
                                             for m in messages],
                                   session=session or "", params=sampling_params(**params), keep_session=keep_session,
                                   tree_budget=tree_budget)


Event = gateway_pb2.GenerateChunk | common_pb2.PrefillProgress


class _Output:
    """What a Generate stream delivered so far; `summary` is set by its last message."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[common_pb2.TokenLogprob] = []  # one per token, when asked for
        self.prompt: gateway_pb2.PromptLogprobs | None = None  # the prompt's logprobs, when asked for
        self.acceptance_lengths: list[int] = []
        self.summary: gateway_pb2.GenerateSummary | None = None
        # time.monotonic() when the first and the latest tokens arrived here (a stopped call has no summary)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def _take(self, reply: gateway_pb2.GenerateReply) -> Event | None:
        if reply.HasField("summary"):
            self.summary = reply.summary
            return None
        if reply.HasField("prefill"):
            return reply.prefill
        if reply.HasField("prompt"):
            self.prompt = reply.prompt
            return None
        chunk = reply.chunk
        if chunk.token_ids:
            self.last_token_at = time.monotonic()
            self.first_token_at = self.first_token_at or self.last_token_at
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.acceptance_lengths.append(chunk.acceptance_length)
        return chunk


class Generation(_Output):
    """A running Generate call: iterate it for chunks (or `events()` for the prefill's progress too); `summary`
    once it ends; `cancel()` to stop it."""

    def __init__(self, call: grpc.Call):
        super().__init__()
        self._call = call

    def events(self) -> Iterator[Event]:
        """A long prefill's progress, then the chunks."""
        try:
            for reply in self._call:
                event = self._take(reply)
                if event is not None:
                    yield event
        except grpc.RpcError as error:
            raise _gateway_error(error) from error

    def __iter__(self) -> Iterator[gateway_pb2.GenerateChunk]:
        return (event for event in self.events() if isinstance(event, gateway_pb2.GenerateChunk))

    def result(self) -> gateway_pb2.GenerateSummary:
        """Read the rest of the stream and return the summary."""
        for _ in self:
            pass
        return self.summary

    def cancel(self) -> None:
        self._call.cancel()


class AsyncGeneration(_Output):
    """The asyncio twin of Generation: `async for chunk in generation`."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        super().__init__()
        self._call = call

    async def events(self) -> AsyncIterator[Event]:
        try:
            async for reply in self._call:
                event = self._take(reply)
                if event is not None:
                    yield event
        except grpc.RpcError as error:
            raise _gateway_error(error) from error

    async def __aiter__(self) -> AsyncIterator[gateway_pb2.GenerateChunk]:
        async for event in self.events():
            if isinstance(event, gateway_pb2.GenerateChunk):
                yield event

    async def result(self) -> gateway_pb2.GenerateSummary:
        async for _ in self:
            pass
        return self.summary

    def cancel(self) -> None:
        self._call.cancel()


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class Client:
    """Blocking client. `timeout` (seconds) is the deadline of each call; the gateway passes what is
    left of it on to the verifier. `tls`: None dials in plaintext; a certificate file that cannot be used is a
    ValueError naming it."""

    def __init__(self, target: str = DEFAULT_GATEWAY, api_key: str | None = None, timeout: float | None = None,
                 tls: Tls | None = None):
        self._channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS) if tls is None else \
            grpc.secure_channel(target, tls.channel_credentials(), options=_CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata = _metadata(api_key)
        self.timeout = timeout

    def generate(self, text: str = "", **options) -> Generation:
        """Start a generation (options as in `generate_request`); iterate the result for chunks."""
        call = self._stub.Generate(generate_request(text, **options), timeout=self.timeout, metadata=self._metadata)
        return Generation(call)

    def chat(self, messages: Sequence[Mapping[str, str]], **options) -> Generation:
        """A generation over the model's chat template (options as in `chat_request`); with `session`, the
        messages are the turns after its last reply."""
        call = self._stub.Chat(chat_request(messages, **options), timeout=self.timeout, metadata=self._metadata)
        return Generation(call)

    def create_session(self, text: str = "", token_ids: Sequence[int] = (),
                       prompt_logprobs: int | None = None) -> gateway_pb2.CreateSessionReply:
        return self._unary(self._stub.CreateSession, gateway_pb2.CreateSessionRequest(
            text=text, token_ids=token_ids, prompt_logprobs=prompt_logprobs))

    def fork_session(self, handle: str) -> gateway_pb2.SessionInfo:
        return self._unary(self._stub.ForkSession, gateway_pb2.ForkSessionRequest(session=handle))

    def release_session(self, handle: str) -> None:
        self._unary(self._stub.ReleaseSession, gateway_pb2.ReleaseSessionRequest(session=handle))

    def get_session(self, handle: str) -> gateway_pb2.SessionInfo:
        return self._unary(self._stub.GetSession, gateway_pb2.GetSessionRequest(session=handle))

    def list_sessions(self) -> list[gateway_pb2.SessionInfo]:
        return list(self._unary(self._stub.ListSessions, gateway_pb2.ListSessionsRequest()).sessions)

    def list_models(self) -> list[gateway_pb2.ModelInfo]:
        return list(self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest()).models)

    def info(self) -> gateway_pb2.InfoReply:
        return self._unary(self._stub.Info, gateway_pb2.InfoRequest())

    def _unary(self, method: grpc.UnaryUnaryMultiCallable, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise _gateway_error(error) from error

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncClient:
    """The asyncio client: the same methods as Client, as coroutines (generate returns an
    AsyncGeneration at once). Create it inside the running event loop."""

    def __init__(self, target: str = DEFAULT_GATEWAY, api_key: str | None = None, timeout: float | None = None,
                 tls: Tls | None = None):
        self._channel = client_channel(target, tls, _CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata = _metadata(api_key)
        self.timeout = timeout

    def generate(self, text: str = "", **options) -> AsyncGeneration:
        call = self._stub.Generate(generate_request(text, **options), timeout=self.timeout, metadata=self._metadata)
        return AsyncGeneration(call)

    def chat(self, messages: Sequence[Mapping[str, str]], **options) -> AsyncGeneration:
        call = self._stub.Chat(chat_request(messages, **options), timeout=self.timeout, metadata=self._metadata)
        return AsyncGeneration(call)

    async def create_session(self, text: str = "", token_ids: Sequence[int] = (),
                             prompt_logprobs: int | None = None) -> gateway_pb2.CreateSessionReply:
        return await self._unary(self._stub.CreateSession, gateway_pb2.CreateSessionRequest(
            text=text, token_ids=token_ids, prompt_logprobs=prompt_logprobs))

    async def fork_session(self, handle: str) -> gateway_pb2.SessionInfo:
        return await self._unary(self._stub.ForkSession, gateway_pb2.ForkSessionRequest(session=handle))

    async def release_session(self, handle: str) -> None:
        await self._unary(self._stub.ReleaseSession, gateway_pb2.ReleaseSessionRequest(session=handle))

    async def get_session(self, handle: str) -> gateway_pb2.SessionInfo:
        return await self._unary(self._stub.GetSession, gateway_pb2.GetSessionRequest(session=handle))

    async def list_sessions(self) -> list[gateway_pb2.SessionInfo]:
        return list((await self._unary(self._stub.ListSessions, gateway_pb2.ListSessionsRequest())).sessions)

    async def list_models(self) -> list[gateway_pb2.ModelInfo]:
        return list((await self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest())).models)

    async def info(self) -> gateway_pb2.InfoReply:
        return await self._unary(self._stub.Info, gateway_pb2.InfoRequest())

    async def _unary(self, method: grpc.aio.UnaryUnaryMultiCallable, request):
        try:
            return await method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise _gateway_error(error) from error

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
