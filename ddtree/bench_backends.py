"""Where `ddtree bench` sends its requests: the gateway's gRPC Generate stream, or POST /v1/completions of any
OpenAI-compatible HTTP server (aiohttp, streamed as server-sent events). Each backend streams one request into
a RequestRecord; `errors` are the exceptions that fail one request (counted) rather than the benchmark."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Protocol

import aiohttp
import grpc

from ddtree.bench import BenchRequest, RequestRecord
from ddtree.client import AsyncClient
from proto.security import client_tls


class ConnectFailed(RuntimeError):
    """The server did not answer the benchmark's first call (models, info): nothing was measured."""


class RequestFailed(RuntimeError):
    """A request the server refused or ended with an error (HTTP status, an error event)."""


class Backend(Protocol):
    model: str
    token_pool: Sequence[int] | None  # synthetic prompts as token ids drawn from here; None: as text
    errors: tuple[type[BaseException], ...]

    async def send(self, request: BenchRequest, record: RequestRecord) -> None: ...

    async def close(self) -> None: ...


async def open_backend(args: argparse.Namespace) -> Backend:
    return await (GrpcBackend if args.backend == "grpc" else OpenAIBackend).open(args)


class GrpcBackend:
    """The gateway's Generate stream: one chunk per verify step, with its acceptance length. Synthetic prompts
    are token ids (exact lengths) from the model's vocabulary, end-of-sequence ids left out."""

    errors = (grpc.RpcError,)

    def __init__(self, client: AsyncClient, model: str, token_pool: Sequence[int], args: argparse.Namespace):
        self._client, self.model, self.token_pool = client, model, token_pool
        self._temperature, self._ignore_eos = args.temperature, args.ignore_eos

    @classmethod
    async def open(cls, args: argparse.Namespace) -> GrpcBackend:
        client = AsyncClient(args.address, api_key=args.api_key, timeout=args.timeout, tls=client_tls(args))
        try:
            model = (await client.info()).model
        except grpc.RpcError as error:
            await client.close()
            raise ConnectFailed(f"{args.address}: {error}") from None
        eos = set(model.eos_token_ids)
        return cls(client, model.name, [t for t in range(model.vocab_size) if t not in eos], args)

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        generation = self._client.generate(request.text, token_ids=request.token_ids,
                                           max_new_tokens=request.max_tokens, temperature=self._temperature,
                                           ignore_eos=self._ignore_eos)
        async for chunk in generation:
            record.add_chunk(len(chunk.token_ids), time.perf_counter())
        record.input_tokens = generation.summary.prompt_tokens
        record.cached_tokens = generation.summary.cached_tokens
        record.acceptance_lengths = generation.acceptance_lengths

    async def close(self) -> None:
        await self._client.close()


class OpenAIBackend:
    """POST /v1/completions with stream=true. Text prompts only; a streamed chunk counts as one token unless it
    carries the cumulative usage (vLLM's continuous_usage_stats); the output and prompt lengths are the final
    usage's (stream_options.include_usage) where the server sends it."""

    token_pool = None
    errors = (aiohttp.ClientError, asyncio.TimeoutError, RequestFailed)

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, temperature: float):
        self._session, self._base_url, self.model, self._temperature = session, base_url, model, temperature

    @classmethod
    async def open(cls, args: argparse.Namespace) -> OpenAIBackend:
        if args.ignore_eos:
            raise ValueError("--ignore-eos: the OpenAI API has no such field (output lengths are reported instead)")
        if not args.address.startswith(("http://", "https://")):
            raise ValueError(f"--address: the openai backend takes a URL (http://HOST:PORT), got {args.address!r}")
        base_url = args.address.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        # NOTE: no connection limit (aiohttp's default is 100): the client must not queue what the server should
        tls = client_tls(args)
        if tls is not None and not base_url.startswith("https://"):
            raise ValueError(f"--address: TLS options need an https:// URL, got {args.address!r}")
        ssl_check = tls.client_ssl_context() if tls is not None else True  # True: aiohttp checks the system roots
        session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=args.timeout),
                                        connector=aiohttp.TCPConnector(limit=0, ssl=ssl_check))
        try:
            model = args.model or await _first_model(session, base_url)
        except cls.errors as error:
            await session.close()
            raise ConnectFailed(f"{base_url}/v1/models: {str(error) or type(error).__name__}") from None
        return cls(session, base_url, model, args.temperature)

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        payload = {"model": self.model, "prompt": request.text, "max_tokens": request.max_tokens,
                   "temperature": self._temperature, "stream": True, "stream_options": {"include_usage": True}}
        async with self._session.post(f"{self._base_url}/v1/completions", json=payload) as response:
            await _check_status(response)
            usage = {}
            async for data in sse_data(response.content):
                if data == "[DONE]":
                    break
                event = _event(data)
                usage = event.get("usage") or usage
                choices = event.get("choices") or ()
                if choices and choices[0].get("text"):
                    tokens = (event.get("usage") or {}).get("completion_tokens", record.output_tokens + 1)
                    record.add_chunk(tokens - record.output_tokens, time.perf_counter())
        if usage:
            record.output_tokens, record.input_tokens = usage["completion_tokens"], usage.get("prompt_tokens")
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    async def close(self) -> None:
        await self._session.close()


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as response:
        await _check_status(response)
        models = (await response.json()).get("data") or ()
    if not models:
        raise RequestFailed("the server lists no models")
    return models[0]["id"]


async def _check_status(response: aiohttp.ClientResponse) -> None:
    if response.status != 200:
        raise RequestFailed(f"HTTP {response.status}: {(await response.text()).strip()[:200]}")


def _event(data: str) -> dict:
    try:
        event = json.loads(data)
    except ValueError:
        raise RequestFailed(f"not a JSON event: {data[:100]!r}") from None
    if "error" in event:
        error = event["error"]
        raise RequestFailed(error.get("message", str(error)) if isinstance(error, dict) else str(error))
    return event


async def sse_data(lines: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The data of each server-sent event: its `data:` lines joined by newlines (other fields ignored)."""
    data: list[str] = []
    async for raw in lines:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)
