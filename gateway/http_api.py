"""The OpenAI-compatible HTTP API, served by aiohttp on the gateway's event loop beside gRPC.

Thin like gateway/servicer.py: learn the caller (the same API keys, `Authorization: Bearer <key>`), read the
JSON (gateway/openai_requests.py), call GatewayService as the gRPC methods do, shape the reply
(gateway/openai_responses.py). Failures are the gRPC layer's exceptions, answered as OpenAI's error object with
the HTTP status of their gRPC code (gateway/http_errors.py); one that comes after a stream began is its last
event instead.

Sessions (KV state handles) through the "ddtree" request field: `session` continues one, `keep_session` keeps a
new one (or the fork), `fork` continues a fork of `session` and leaves it as it was. The reply's "ddtree"
object names the session it lives on. `DELETE /v1/sessions/{session}` releases one.

`n` choices are n generations on forks of one session (GatewayService.generate_choices), their chunks interleaved
in a stream as they come, each naming its choice's `index`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from aiohttp import web

from gateway import validation
from gateway.auth import ApiKeys
from gateway.errors import InvalidArgument, ModelNotFound
from gateway.http_errors import NAMES_FIELD, error_body, http_error
from gateway.openai_logprobs import ChoiceLogprobs, TokenSpelling, joined, prompt_logprobs
from gateway.openai_requests import OpenAIRequest, chat_request, completion_request
from gateway.openai_responses import CHAT, COMPLETIONS, Endpoint, Reply
from gateway.service import Caller, GatewayService
from proto import gateway_pb2
from proto.serving import check_bindable
from proto.status import StatusError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpApi:
    def __init__(self, service: GatewayService, keys: ApiKeys):
        self.service = service
        self.keys = keys
        self.spelling = TokenSpelling(service.tokenizer)
        self._started = int(time.time())

    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.service.config.max_message_bytes, middlewares=[self._errors])
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models),
                        web.delete("/v1/sessions/{session}", self.release_session),
                        web.get("/health", self.health)])
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        parsed = completion_request(await _json(request))
        with _named_as(parsed.names):
            self._check_model(parsed.model)
            prompt = await self.service.prompt(parsed.text, parsed.token_ids, required=not parsed.session)
            validation.check_prompt_logprobs(parsed.prompt_logprobs)
            return await self._generate(request, caller, parsed, prompt, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        parsed = chat_request(await _json(request))
        with _named_as(parsed.names):
            self._check_model(parsed.model)
            prompt = await self.service.chat_prompt(caller, parsed.messages, parsed.session)
            return await self._generate(request, caller, parsed, prompt, CHAT)

    async def models(self, request: web.Request) -> web.Response:
        self._caller(request)  # NOTE: authenticates; the models are the same for every caller
        model = self.service.model_info()
        return web.json_response({"object": "list", "data": [
            {"id": model.name, "object": "model", "created": self._started, "owned_by": "ddtree-serve",
             "max_model_len": model.max_context}]})

    async def release_session(self, request: web.Request) -> web.Response:
        handle = request.match_info["session"]
        await self.service.release_session(self._caller(request), handle)
        return web.json_response({"id": handle, "object": "session", "deleted": True})

    async def health(self, request: web.Request) -> web.Response:
        """200 while a verifier serves (no key needed: for load balancers), else 503."""
        if self.service.pool.up:
            return web.json_response({"status": "ok"})
        return web.json_response(error_body("no verifier is serving", "service_unavailable_error", "unavailable"),
                                 status=503)

    def _caller(self, request: web.Request) -> Caller:
        owner = self.keys.authenticate(request.headers.items())
        return self.service.caller(owner, _peer(request.remote), timeout=None)

    def _check_model(self, name: str) -> None:
        served = self.service.model_info().name
        if name and name != served:
            raise ModelNotFound(f"model: {name!r} is not served here (this gateway serves {served!r})")

    async def _generate(self, request: web.Request, caller: Caller, parsed: OpenAIRequest, prompt: list[int],
                        endpoint: Endpoint) -> web.StreamResponse:
        params = self.service.params(parsed.params)
        model = self.service.model_info()
        reply = Reply(endpoint, model.name, parsed.n, parsed.include_usage)
        text = _ReplyText(self.service, set(model.eos_token_ids))
        # NOTE: one per choice: a completion's text offsets run on across its own chunks
        logprobs = [ChoiceLogprobs(self.spelling, endpoint.chat) if params.HasField("logprobs") else None
                    for _ in range(parsed.n)]
        echo = (parsed.text or self.service.tokenizer.decode(prompt)) if parsed.echo else None
        if parsed.prompt_only:
            replies = self.service.prompt_choices(caller, prompt, parsed.prompt_width, parsed.n, parsed.keep_session)
        else:
            replies = self.service.generate_choices(caller, prompt, params, parsed.n, parsed.session,
                                                    parsed.keep_session, parsed.fork, parsed.prompt_width)
        async with contextlib.aclosing(replies):
            started = await _started(replies)  # NOTE: a failure before any output is the reply's own status
            if parsed.stream:
                return await self._stream(request, reply, started, text, logprobs, echo, parsed.echo_logprobs)
            chunks: list[list[gateway_pb2.GenerateChunk]] = [[] for _ in range(parsed.n)]
            summaries: dict[int, gateway_pb2.GenerateSummary] = {}
            scored: dict[int, gateway_pb2.PromptLogprobs] = {}
            async for index, message in started:
                if message.HasField("summary"):
                    summaries[index] = message.summary
                elif message.HasField("prompt"):
                    scored[index] = message.prompt
                else:
                    chunks[index].append(message.chunk)
            # NOTE: the echoed prompt's logprobs first: its text offsets come before the reply's
            echoed = [None if parsed.echo_logprobs is None else lp.prompt(scored[i], parsed.echo_logprobs)
                      for i, lp in enumerate(logprobs)]
            vllm = None if parsed.prompt_logprobs is None else [
                prompt_logprobs(self.spelling, scored[i], parsed.prompt_logprobs) for i in range(parsed.n)]
            return web.json_response(reply.body([(echo or "") + "".join(map(text, c)) for c in chunks],
                                                [summaries[i] for i in range(parsed.n)],
                                                [joined([e, _logprobs_of(lp, c)])
                                                 for e, lp, c in zip(echoed, logprobs, chunks)], vllm))

    async def _stream(self, request: web.Request, reply: Reply,
                      replies: AsyncIterator[tuple[int, gateway_pb2.GenerateReply]], text: _ReplyText,
                      logprobs: Sequence[ChoiceLogprobs | None], echo: str | None,
                      echo_logprobs: int | None) -> web.StreamResponse:
        """Server-sent events: OpenAI's chunks, each of one choice as its tokens come, then `data: [DONE]`; a failure
        is the last event instead. An `echo`ed prompt is each choice's first chunk, as vLLM sends it: with its
        logprobs once they come (`echo_logprobs` alternatives), else at once."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in reply.first_chunks():
            await _send(response, chunk)
        if echo is not None and echo_logprobs is None:
            for index in range(reply.n):
                await _send(response, reply.chunk(index, {"content": echo}))
        try:
            async for index, message in replies:
                if message.HasField("summary"):
                    for chunk in reply.last_chunks(index, message.summary):
                        await _send(response, chunk)
                elif message.HasField("prompt"):
                    await _send(response, reply.chunk(index, {"content": echo},
                                                      logprobs[index].prompt(message.prompt, echo_logprobs)))
                elif (delta := text(message.chunk)) or message.chunk.logprobs:
                    await _send(response, reply.chunk(index, {"content": delta},
                                                      _logprobs_of(logprobs[index], [message.chunk])))
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client went away between two writes: as a cancellation
            self._count(grpc.StatusCode.CANCELLED)
        except Exception as error:  # noqa: BLE001 - the status line is sent: the error becomes an event
            with contextlib.suppress(ConnectionResetError):
                await _send(response, self._error(error)[1])
        return response

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure as OpenAI's error object, counted in the same metric as gRPC's."""
        try:
            return await handler(request)
        except web.HTTPException as error:  # aiohttp's own: no such route or method, a body over the limit
            if error.status < 400:
                raise
            code = error.reason.lower().replace(" ", "_")
            return web.json_response(error_body(error.text or error.reason, "invalid_request_error", code),
                                     status=error.status)
        except asyncio.CancelledError:  # the client went away
            self._count(grpc.StatusCode.CANCELLED)
            raise
        except Exception as error:  # noqa: BLE001 - the one place HTTP errors become replies
            status, body = self._error(error)
            return web.json_response(body, status=status)

    def _error(self, error: Exception) -> tuple[int, dict]:
        """The HTTP status and body of a failure."""
        code, http, body = http_error(error)
        self._count(code)
        return http, body

    def _count(self, code: grpc.StatusCode) -> None:
        self.service.metrics.errors.labels(code.name).inc()


class _ReplyText:
    """A chunk's text as OpenAI's content: without the text of the stop token that ended the reply (an EOS such
    as `<|im_end|>` closes the turn; it is no part of what the model said)."""

    def __init__(self, service: GatewayService, stop_ids: set[int]):
        self._decode = service.tokenizer.decode
        self._stop_ids = stop_ids

    def __call__(self, chunk: gateway_pb2.GenerateChunk) -> str:
        if chunk.token_ids and chunk.token_ids[-1] in self._stop_ids:
            return chunk.text.removesuffix(self._decode([chunk.token_ids[-1]]))
        return chunk.text


def _logprobs_of(logprobs: ChoiceLogprobs | None, chunks: Sequence[gateway_pb2.GenerateChunk]) -> dict | None:
    """The chunks' tokens' logprobs as the choice's `logprobs` (a stream chunk's own, or the whole reply's); None
    when the request asked for none."""
    if logprobs is None:
        return None
    return logprobs([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs])


@contextlib.contextmanager
def _named_as(names: Mapping[str, str]) -> Iterator[None]:
    """A failure whose message starts with a field of the domain's (`text`, `params.temperature`, `session`) is
    raised again with the request's name for it, which its reply names as `param`."""
    try:
        yield
    except StatusError as error:
        field, sep, rest = str(error).partition(": ")
        if error.code not in NAMES_FIELD or not sep or field not in names:
            raise
        raise type(error)(f"{names[field]}: {rest}") from None


async def _started(replies: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    """`replies` (each with its choice's index) without prefill progress (OpenAI's replies have no place for it),
    with the first output awaited now, so that a failure before any output raises here: a prompt that waited for KV
    pages in vain is a 429, not an error event after a 200."""
    first = await anext(replies)
    while first[1].HasField("prefill"):
        first = await anext(replies)

    async def chained() -> AsyncIterator[tuple[int, Any]]:
        yield first
        async for index, message in replies:
            if not message.HasField("prefill"):
                yield index, message
    return chained()


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidArgument(f"request body: not JSON ({error})") from None


async def _send(response: web.StreamResponse, event: Mapping[str, Any]) -> None:
    await response.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())


def _peer(remote: str | None) -> str:
    """The client's address as gRPC names a peer without its port (`ipv4:10.0.0.7`, `ipv6:[::1]`), so that
    quotas by peer count its gRPC and HTTP calls together."""
    if remote is None:
        return "unknown"
    return f"ipv6:[{remote}]" if ":" in remote else f"ipv4:{remote}"


async def serve_http(api: HttpApi, address: str, grace_s: float,
                     ssl_context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, int]:
    """Listen on `address` (host:port; port 0 picks a free one), with TLS when there is an `ssl_context`; returns
    the runner and the bound port. A taken port is a BindError naming it. Stopping the runner lets running
    requests finish within `grace_s`."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"{address}: the HTTP address must be host:port")
    check_bindable(address)
    # NOTE: a client that goes away cancels its handler, and so its generation, as over gRPC.
    runner = web.AppRunner(api.application(), handler_cancellation=True, access_log=None, shutdown_timeout=grace_s)
    await runner.setup()
    await web.TCPSite(runner, host.strip("[]") or None, int(port), ssl_context=ssl_context).start()
    return runner, runner.addresses[0][1]
