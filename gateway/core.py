"""What the gateway does, in domain terms: session handles over verifier sessions, and generation.

The servicer (gateway/service.py) authenticates and validates at the edge and calls one method
here; exceptions become status codes in gateway/errors.py. `timeout` is the caller's remaining
deadline, passed on to every verifier call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import metadata

import grpc

from gateway import requests
from gateway.config import GatewayConfig
from gateway.errors import SessionBusy
from gateway.generation import Relay
from gateway.metrics import GatewayMetrics
from gateway.sessions import SessionEntry, SessionNotFound, SessionRegistry, TooManySessions
from gateway.text import OutputText
from gateway.verifiers import VerifierPool
from modeling.tokenizer import Tokenizer
from proto import common_pb2, gateway_pb2, verifier_pb2

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        return metadata.version("ddtree-serve")
    except metadata.PackageNotFoundError:
        return "unknown"


class GatewayCore:
    def __init__(self, config: GatewayConfig, pool: VerifierPool, tokenizer: Tokenizer, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.registry = SessionRegistry(config.session_idle_ttl_s, config.max_sessions_per_key, clock=clock)
        self._clock = clock
        metrics.count_sessions(lambda: len(self.registry))

    # -- the edge's checks, against the model the verifiers serve

    def prompt(self, text: str, token_ids: Sequence[int], required: bool) -> list[int]:
        model = self._known_model()
        return requests.prompt_ids(text, token_ids, self.tokenizer, required=required,
                                   vocab_size=model.vocab_size if model else None,
                                   max_context=model.max_context if model else None)

    def params(self, params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        model = self._known_model()
        return requests.checked_params(params, self.config, model.vocab_size if model else None)

    # -- sessions

    async def create_session(self, owner: str | None, prompt: list[int],
                             timeout: float | None) -> gateway_pb2.CreateSessionReply:
        """Prefill `prompt` on the verifier with the most free pages; hand back a new handle."""
        self._check_room(owner)
        address = self.pool.pick()
        reply = await self.pool.stub(address).CreateSession(
            verifier_pb2.VerifierCreateSessionRequest(prompt_token_ids=prompt), timeout=timeout)
        entry = await self._register(owner, address, reply.session)
        return gateway_pb2.CreateSessionReply(session=self._info(entry, reply.session), prefill_ms=reply.prefill_ms)

    async def fork_session(self, owner: str | None, handle: str, timeout: float | None) -> gateway_pb2.SessionInfo:
        parent = self.registry.get(handle, owner)
        self._check_room(owner)
        forked = await self.pool.stub(parent.verifier).ForkSession(
            verifier_pb2.VerifierForkSessionRequest(session_id=parent.verifier_session_id), timeout=timeout)
        entry = await self._register(owner, parent.verifier, forked)
        return self._info(entry, forked)

    async def release_session(self, owner: str | None, handle: str) -> None:
        if self.registry.peek(handle, owner).in_use:
            raise SessionBusy("session: a generation runs on it; cancel it first")
        entry = self.registry.remove(handle, owner)
        await self._release_quietly(entry.verifier, entry.verifier_session_id)

    async def get_session(self, owner: str | None, handle: str, timeout: float | None) -> gateway_pb2.SessionInfo:
        entry = self.registry.peek(handle, owner)
        held = await self.pool.stub(entry.verifier).GetSession(
            verifier_pb2.VerifierGetSessionRequest(session_id=entry.verifier_session_id), timeout=timeout)
        return self._info(entry, held)

    async def list_sessions(self, owner: str | None, timeout: float | None) -> gateway_pb2.ListSessionsReply:
        """The owner's sessions; one whose verifier does not answer is listed with the gateway's figures only."""
        entries = self.registry.owned_by(owner)
        held = await asyncio.gather(*(self.pool.stub(e.verifier).GetSession(
            verifier_pb2.VerifierGetSessionRequest(session_id=e.verifier_session_id), timeout=timeout)
            for e in entries), return_exceptions=True)
        return gateway_pb2.ListSessionsReply(sessions=[
            self._info(e, None if isinstance(h, BaseException) else h) for e, h in zip(entries, held)])

    # -- generation

    async def generate(self, owner: str | None, prompt: list[int], params: common_pb2.SamplingParams,
                       handle: str, keep_session: bool,
                       timeout: float | None) -> AsyncIterator[gateway_pb2.GenerateReply]:
        """Chunks, then the summary. Without `handle` the prompt goes to a fresh session (held under a
        handle while it runs, so it counts against the key's limit); with one, it is appended."""
        started = self._clock()
        if handle:
            append, keep = prompt, True
        else:
            handle = (await self.create_session(owner, prompt, timeout)).session.session
            append, keep = [], keep_session
        relay = Relay(OutputText(self.tokenizer, params.stop_strings), self.metrics, self._clock, started)
        try:
            with self.registry.using(handle, owner) as entry:
                request = verifier_pb2.VerifierGenerateRequest(session_id=entry.verifier_session_id,
                                                               append_token_ids=append, params=params,
                                                               keep_session=keep)
                left = None if timeout is None else max(0.0, timeout - (self._clock() - started))
                call = self.pool.stub(entry.verifier).Generate(request, timeout=left)
                try:
                    async for step in call:
                        yield relay.chunk(step)
                except grpc.aio.AioRpcError as exc:
                    if not relay.steps:
                        if not keep:
                            await self._release_quietly(entry.verifier, entry.verifier_session_id)
                        raise
                    # NOTE: the tokens already sent are exact; the summary says the rest failed.
                    log.warning("verifier %s failed mid-generation: %s %s", entry.verifier, exc.code(), exc.details())
                    self.metrics.errors.labels(exc.code().name).inc()
                finally:
                    call.cancel()  # a no-op once the stream ended; stops the verifier when we were cancelled
        finally:
            if not keep:
                self._forget(handle, owner)
        yield relay.summary(handle if keep else "", prompt_tokens=len(prompt))

    # -- model and service

    def model_info(self) -> gateway_pb2.ModelInfo:
        model = self.pool.model()
        return gateway_pb2.ModelInfo(name=model.model_name, max_context=model.max_context,
                                     vocab_size=model.vocab_size, eos_token_ids=model.eos_token_ids)

    def info(self, auth_required: bool) -> gateway_pb2.InfoReply:
        reply = gateway_pb2.InfoReply(
            version=_version(), verifiers=len(self.pool.addresses), verifiers_up=len(self.pool.up),
            auth_required=auth_required, session_idle_ttl_s=self.config.session_idle_ttl_s,
            max_sessions_per_key=self.config.max_sessions_per_key,
            max_new_tokens_limit=self.config.max_new_tokens_limit,
            default_max_new_tokens=self.config.default_max_new_tokens)
        if self.pool.up:
            reply.model.CopyFrom(self.model_info())
        return reply

    async def refresh(self) -> None:
        """Housekeeping: poll the verifiers' Info and release sessions idle past the TTL."""
        await self.pool.poll(self.config.verifier_info_timeout_s)
        self.metrics.observe_verifiers(self.pool.infos)
        for entry in self.registry.expire_idle():
            await self._release_quietly(entry.verifier, entry.verifier_session_id)

    # -- helpers

    def _known_model(self) -> verifier_pb2.VerifierInfoReply | None:
        return self.pool.model() if self.pool.up else None

    def _check_room(self, owner: str | None) -> None:
        """Fail before the costly verifier call rather than after it."""
        if not self.registry.can_create(owner):
            raise TooManySessions(f"session: this key already holds {self.config.max_sessions_per_key} sessions; "
                                  "release one first")

    async def _register(self, owner: str | None, address: str,
                        held: verifier_pb2.VerifierSessionInfo) -> SessionEntry:
        try:
            return self.registry.create(owner, address, held.session_id)
        except TooManySessions:  # another call took the last place meanwhile
            await self._release_quietly(address, held.session_id)
            raise

    def _forget(self, handle: str, owner: str | None) -> None:
        try:
            self.registry.remove(handle, owner)
        except SessionNotFound:
            pass

    async def _release_quietly(self, address: str, session_id: str) -> None:
        """Release at the verifier; the handle is gone either way, so a failure is only logged."""
        try:
            await self.pool.stub(address).ReleaseSession(
                verifier_pb2.VerifierReleaseSessionRequest(session_id=session_id),
                timeout=self.config.verifier_info_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("could not release session %s at %s: %s", session_id, address, exc.details())

    def _info(self, entry: SessionEntry, held: verifier_pb2.VerifierSessionInfo | None) -> gateway_pb2.SessionInfo:
        idle = self.registry.idle_for(entry)
        info = gateway_pb2.SessionInfo(session=entry.handle, generating=entry.in_use > 0, idle_s=idle,
                                       expires_in_s=max(0.0, self.config.session_idle_ttl_s - idle))
        if held is not None:
            info.num_tokens, info.pages_used, info.pages_shared = held.num_tokens, held.pages_used, held.pages_shared
            info.generating |= held.generating
        return info
