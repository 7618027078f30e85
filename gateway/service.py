"""What the gateway does, in domain terms: session handles over verifier sessions, and generation.

The servicer (gateway/servicer.py) authenticates and validates at the edge and calls one method
here; exceptions become status codes in gateway/errors.py. Every verifier call has a deadline: the
caller's remaining one, capped by the gateway's own (a Generate stream has the caller's only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TypeVar

import grpc

from gateway import validation
from gateway.chat_template import ChatTemplate
from gateway.choices import choice_params, interleaved
from gateway.config import GatewayConfig
from gateway.errors import InvalidArgument, NoVerifier, QuotaExceeded, SessionBusy, SessionNotFound, TooManySessions
from gateway.generation import Relay
from gateway.metrics import GatewayMetrics
from gateway.sessions import SessionEntry, SessionRegistry
from gateway.text import OutputText
from gateway.verifiers import VerifierPool
from modeling.tokenizer import Tokenizer
from proto import common_pb2, gateway_pb2, verifier_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Caller:
    owner: str | None  # the API key's digest; None when keys are off
    account: str | None  # what its quotas count against; None = the account all callers share
    timeout: float | None  # seconds left of the caller's deadline


def _version() -> str:
    try:
        return metadata.version("ddtree-serve")
    except metadata.PackageNotFoundError:
        return "unknown"


class GatewayService:
    def __init__(self, config: GatewayConfig, pool: VerifierPool, tokenizer: Tokenizer, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic, chat_template: ChatTemplate | None = None):
        self.config = config
        self.pool = pool
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: the model has none, and chat requests are refused
        self.metrics = metrics
        self.registry = SessionRegistry(config.session_idle_ttl_s, config.max_sessions_per_key, clock=clock)
        self._clock = clock
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(config.tokenizer_threads, "tokenize")
        self._token_bytes = tokenizer.max_token_bytes()
        metrics.count_sessions(lambda: len(self.registry))

    # -- the edge's checks, against the model the verifiers serve

    def caller(self, owner: str | None, peer: str, timeout: float | None) -> Caller:
        """Who calls, over gRPC or HTTP: `owner` from its API key, `peer` its address without the port."""
        return Caller(owner, peer if self.config.quota_by == "peer" else owner, timeout)

    async def prompt(self, text: str, token_ids: Sequence[int], required: bool) -> list[int]:
        """The prompt's ids: oversized text is refused by its length alone, the rest tokenized off the loop."""
        model = self._known_model()
        validation.check_prompt_text(text, token_ids, self._prompt_byte_limit())
        if text:
            token_ids = await self._off_loop(self.tokenizer.encode, text)
        return validation.prompt_ids(token_ids, required=required, vocab_size=model.vocab_size if model else None,
                                   max_context=model.max_context if model else None)

    async def chat_prompt(self, caller: Caller, messages: Sequence[Mapping[str, str]], handle: str) -> list[int]:
        """The prompt of a chat turn: `messages` in the model's chat template with the generation prompt. With a
        session, they are the turns after its last reply (ChatTemplate.continuation), appended to it."""
        if self.chat_template is None:
            raise InvalidArgument("messages: the model has no chat template (chat_template in tokenizer_config.json "
                                  "or chat_template.jinja); send the prompt as text instead")
        validation.check_messages(messages, self._prompt_byte_limit())
        if handle:
            stop_token = self.registry.peek(handle, caller.owner).stop_token
            reply_end = "" if stop_token is None else self.tokenizer.decode([stop_token])
            render = functools.partial(self.chat_template.continuation, messages, reply_end)
        else:
            render = functools.partial(self.chat_template.render, messages, add_generation_prompt=True)
        return await self.prompt(await self._off_loop(render), (), required=True)

    async def _off_loop(self, work: Callable[..., T], *args: object) -> T:
        """Tokenizing and template rendering take long over long text: they run in the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work, *args)

    def _prompt_byte_limit(self) -> int | None:
        if self.config.max_prompt_bytes:
            return self.config.max_prompt_bytes
        model = self._known_model()
        # NOTE: a token spells at most `_token_bytes` bytes; x2 for normalizers that shrink text (NFC).
        return None if model is None else 2 * model.max_context * self._token_bytes

    def params(self, params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        model = self._known_model()
        return validation.checked_params(params, self.config, model.vocab_size if model else None)

    # -- sessions

    async def create_session(self, caller: Caller, prompt: list[int],
                             prompt_logprobs: int | None = None) -> gateway_pb2.CreateSessionReply:
        """Prefill `prompt` on the verifier with the most KV room (VerifierPool.pick); hand back a new handle, and with
        `prompt_logprobs` (alternatives) the logprobs of the prompt's tokens but the first."""
        validation.check_prompt_logprobs(prompt_logprobs)
        address = self.pool.pick()
        self._check_room(caller.account, len(prompt))
        request = verifier_pb2.VerifierCreateSessionRequest(prompt_token_ids=prompt, prompt_logprobs=prompt_logprobs)
        reply = await self.pool.stub(address).CreateSession(
            request, timeout=_capped(caller.timeout, self.config.prefill_timeout_s))
        entry = await self._register(caller, address, reply.session)
        created = gateway_pb2.CreateSessionReply(session=self._info(entry, reply.session), prefill_ms=reply.prefill_ms,
                                                 cached_tokens=reply.cached_tokens)
        if prompt_logprobs is not None:
            created.prompt_logprobs.CopyFrom(_scored(prompt, reply.prompt_logprobs, fresh=True))
        return created

    async def fork_session(self, caller: Caller, handle: str) -> gateway_pb2.SessionInfo:
        parent = self.registry.get(handle, caller.owner)
        self._check_room(caller.account, parent.tokens)
        forked = await self.pool.stub(parent.verifier).ForkSession(
            verifier_pb2.VerifierForkSessionRequest(session_id=parent.verifier_session_id),
            timeout=self._call_timeout(caller))
        entry = await self._register(caller, parent.verifier, forked)
        entry.stop_token = parent.stop_token
        return self._info(entry, forked)

    async def release_session(self, caller: Caller, handle: str) -> None:
        if self.registry.peek(handle, caller.owner).in_use:
            raise SessionBusy("session: a generation runs on it; cancel it first")
        entry = self.registry.remove(handle, caller.owner)
        await self._release_quietly(entry.verifier, entry.verifier_session_id)

    async def get_session(self, caller: Caller, handle: str) -> gateway_pb2.SessionInfo:
        entry = self.registry.peek(handle, caller.owner)
        held = await self.pool.stub(entry.verifier).GetSession(
            verifier_pb2.VerifierGetSessionRequest(session_id=entry.verifier_session_id),
            timeout=self._call_timeout(caller))
        return self._info(entry, held)

    async def list_sessions(self, caller: Caller) -> gateway_pb2.ListSessionsReply:
        """The owner's sessions; one whose verifier does not answer is listed with the gateway's figures only."""
        entries = self.registry.owned_by(caller.owner)
        held = await asyncio.gather(*(self.pool.stub(e.verifier).GetSession(
            verifier_pb2.VerifierGetSessionRequest(session_id=e.verifier_session_id),
            timeout=self._call_timeout(caller)) for e in entries), return_exceptions=True)
        return gateway_pb2.ListSessionsReply(sessions=[
            self._info(e, None if isinstance(h, BaseException) else h) for e, h in zip(entries, held)])

    # -- generation

    async def generate(self, caller: Caller, prompt: list[int], params: common_pb2.SamplingParams, handle: str,
                       keep_session: bool, fork: bool = False, tree_budget: int = 0, started: float | None = None,
                       prompt_logprobs: int | None = None) -> AsyncIterator[gateway_pb2.GenerateReply]:
        """A long prefill's progress, chunks, then the summary. Without `handle` the prompt goes to a fresh
        session (held under a handle while it runs, so it counts against the key's limits), which is dropped if
        the call ends before its prompt is in; with one, it is appended; with `fork`, it is appended to a fork of
        it, which is kept with `keep_session` (the parent stays as it was). A failure after the first chunk ends
        the stream with its status: the chunks sent before it stand (exact). `tree_budget` pins the draft tree
        of every step (0: the verifier's policy; the verifier knows its maximum and checks it). `started`: when the
        request came (default now), from which its first token's time and the caller's deadline count.
        `prompt_logprobs` (alternatives): one `prompt` reply after the prefill, the logprobs of `prompt`'s tokens (all
        of them given the session before, or but the first on a fresh session)."""
        validation.check_tree_budget(tree_budget)
        validation.check_prompt_logprobs(prompt_logprobs)
        started = self._clock() if started is None else started
        fresh = not handle
        if handle and fork:
            handle = (await self.fork_session(caller, handle)).session
            append, keep = prompt, keep_session
        elif handle:
            append, keep = prompt, True
        else:
            # NOTE: the session starts from the prompt's first token and the rest is appended in the Generate
            # stream, whose prefill reports its progress (CreateSession's cannot).
            handle = (await self.create_session(caller, prompt[:1])).session.session
            append, keep = prompt[1:], keep_session
        relay = Relay(OutputText(self.tokenizer, params.stop_strings), self.metrics, self._clock, started)
        try:
            with self.registry.using(handle, caller.owner) as entry:
                self._reserve(entry, len(append) + params.max_new_tokens)
                request = verifier_pb2.VerifierGenerateRequest(session_id=entry.verifier_session_id,
                                                               append_token_ids=append, params=params,
                                                               keep_session=keep, tree_budget=tree_budget,
                                                               prompt_logprobs=prompt_logprobs)
                left = None if caller.timeout is None else max(0.0, caller.timeout - (self._clock() - started))
                steps = self.pool.generate(entry.verifier, request, left)
                try:
                    if prompt_logprobs is not None and not append:  # NOTE: nothing to prefill, so nothing comes
                        yield gateway_pb2.GenerateReply(prompt=_scored(prompt, [], fresh))
                    async for step in steps:
                        if step.prompt_logprobs:
                            yield gateway_pb2.GenerateReply(prompt=_scored(prompt, step.prompt_logprobs, fresh))
                        else:
                            yield relay.reply(step)
                finally:
                    await steps.aclose()  # a no-op once the generation ended; stops it at the verifier otherwise
                    entry.reserved = 0
                    entry.tokens = relay.session_tokens or entry.tokens
                    entry.stop_token = relay.stop_token
                if relay.stop_reason is None:
                    raise NoVerifier("the verifier ended the generation without a stop reason; retry")
        finally:
            if not keep or (fresh and not relay.steps):  # NOTE: as a failed CreateSession keeps nothing
                await self._forget(handle, caller.owner, release=relay.stop_reason is None)
        yield relay.summary(handle if keep else "", prompt_tokens=len(prompt))

    async def generate_choices(self, caller: Caller, prompt: list[int], params: common_pb2.SamplingParams, n: int,
                               handle: str, keep_session: bool, fork: bool = False, prompt_logprobs: int | None = None
                               ) -> AsyncIterator[tuple[int, gateway_pb2.GenerateReply]]:
        """`n` generations of one prompt (OpenAI's `n` choices), their replies interleaved as they come, each with
        its choice's index. One is `generate` itself. More run together, each as `generate` on a fork released at
        its end: forks of `handle` (which stays as it was, `fork` or not), each appending `prompt` itself; without
        a handle, forks of a new session of `prompt`, prefilled once for them all and released last. Choice i
        samples with seed + i (gateway/choices.py). The first failure ends every choice (each releases its fork)
        and is raised once. `prompt_logprobs`: as in `generate`, for every choice: computed once by a new prompt's
        shared prefill; with a handle each choice prefills the prompt on its own fork and scores it there (so that
        its `prompt` reply comes before its own chunks)."""
        validation.check_choices(n, keep_session)
        if n == 1:
            async with contextlib.aclosing(self.generate(caller, prompt, params, handle, keep_session, fork,
                                                         prompt_logprobs=prompt_logprobs)) as one:
                async for reply in one:
                    yield 0, reply
            return
        started, fresh = self._clock(), not handle
        self.registry.check_room(caller.account, n + 1 if fresh else n)  # NOTE: each fork, and the prompt's session
        if fresh:
            created = await self.create_session(caller, prompt, prompt_logprobs)
            handle = created.session.session
        try:
            if fresh and prompt_logprobs is not None:
                for index in range(n):
                    yield index, gateway_pb2.GenerateReply(prompt=created.prompt_logprobs)
            append = [] if fresh else prompt
            # NOTE: from the request's arrival: each choice's first token waited for the shared prefill too
            choices = [self.generate(caller, append, choice_params(params, i), handle, keep_session=False, fork=True,
                                     started=started, prompt_logprobs=None if fresh else prompt_logprobs)
                       for i in range(n)]
            async with contextlib.aclosing(interleaved(choices)) as replies:
                async for index, reply in replies:
                    if reply.HasField("summary"):
                        reply.summary.prompt_tokens = len(prompt)  # NOTE: what this call prefilled, for all choices
                        if fresh:
                            reply.summary.cached_tokens = created.cached_tokens
                    yield index, reply
        finally:
            if fresh:
                await self._forget(handle, caller.owner, release=True)

    async def prompt_choices(self, caller: Caller, prompt: list[int], prompt_logprobs: int | None, n: int,
                             keep_session: bool) -> AsyncIterator[tuple[int, gateway_pb2.GenerateReply]]:
        """The prompt alone, nothing generated (OpenAI's `echo` with max_tokens 0): one prefill into a new session,
        kept with `keep_session`; each of `n` choices gets the `prompt` reply (with `prompt_logprobs`) and a summary of
        no tokens, as `generate_choices` would hand them on."""
        validation.check_choices(n, keep_session)
        started = self._clock()
        created = await self.create_session(caller, prompt, prompt_logprobs)
        handle = created.session.session if keep_session else ""
        if not keep_session:
            await self._forget(created.session.session, caller.owner, release=True)
        summary = gateway_pb2.GenerateSummary(stop_reason=common_pb2.STOP_REASON_LENGTH, session=handle,
                                              prompt_tokens=len(prompt), session_tokens=len(prompt),
                                              cached_tokens=created.cached_tokens,
                                              e2e_ms=1e3 * (self._clock() - started))
        for index in range(n):
            if prompt_logprobs is not None:
                yield index, gateway_pb2.GenerateReply(prompt=created.prompt_logprobs)
            yield index, gateway_pb2.GenerateReply(summary=summary)

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
        """Housekeeping: poll the verifiers, renew the leases of the sessions held here, release the
        sessions idle past the TTL."""
        await self.pool.poll(self.config.verifier_info_timeout_s)
        self.metrics.observe_verifiers(self.pool.infos)
        await asyncio.gather(*(self._renew_leases(address) for address in self.pool.up))
        for entry in self.registry.expire_idle():
            await self._release_quietly(entry.verifier, entry.verifier_session_id)

    async def _renew_leases(self, address: str) -> None:
        held = [e.verifier_session_id for e in self.registry.on_verifier(address)]
        if not held:
            return
        try:
            reply = await self.pool.stub(address).RenewLeases(
                verifier_pb2.VerifierRenewLeasesRequest(session_ids=held), timeout=self.config.verifier_info_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not renew %d session leases at %s: %s", len(held), address, exc.code().name)
            return
        for entry in self.registry.drop_unknown(address, list(reply.unknown_session_ids)):
            log.info("handle of session %s dropped: verifier %s no longer holds it", entry.verifier_session_id,
                     address)

    # -- helpers

    def _known_model(self) -> verifier_pb2.VerifierInfoReply | None:
        return self.pool.model() if self.pool.up else None

    def _call_timeout(self, caller: Caller) -> float:
        return _capped(caller.timeout, self.config.verifier_call_timeout_s)

    def _check_room(self, account: str | None, tokens: int) -> None:
        """Fail before the costly verifier call rather than after it."""
        self.registry.check_room(account)
        self._check_kv(account, tokens)

    def _check_kv(self, account: str | None, adding: int) -> None:
        quota = self._kv_quota(account)
        held = self.registry.kv_tokens(account)
        if quota is not None and held + adding > quota:
            raise QuotaExceeded(f"kv quota: the caller holds {held} of its {quota} KV tokens and asks for {adding} "
                                "more (prompt, appended text and max_new_tokens); release a session first")

    def _kv_quota(self, account: str | None) -> int | None:
        """The account's KV share; None when there is nothing to divide (one shared account, or no verifier
        has said its capacity yet)."""
        capacity = self.pool.kv_capacity_tokens()
        if account is None or not capacity:
            return None
        return int(self.config.kv_share_per_key * capacity)

    def _reserve(self, entry: SessionEntry, tokens: int) -> None:
        """Count what a generation may add against the quota for as long as it runs."""
        self._check_kv(entry.account, tokens)
        entry.reserved = tokens

    async def _register(self, caller: Caller, address: str,
                        held: verifier_pb2.VerifierSessionInfo) -> SessionEntry:
        try:
            return self.registry.create(caller.owner, address, held.session_id, account=caller.account,
                                        tokens=held.num_tokens)
        except TooManySessions:  # another call took the last place meanwhile
            await self._release_quietly(address, held.session_id)
            raise

    async def _forget(self, handle: str, owner: str | None, release: bool) -> None:
        """Drop a one-shot generation's handle; `release` when the verifier may still hold the session (the
        call failed or was cancelled, maybe before the verifier's Generate began and could release it)."""
        try:
            entry = self.registry.remove(handle, owner)
        except SessionNotFound:
            return
        if release:
            await self._release_quietly(entry.verifier, entry.verifier_session_id)

    async def _release_quietly(self, address: str, session_id: str) -> None:
        """Release at the verifier; the handle is gone either way, so a failure is only logged (the session's
        lease then frees it)."""
        try:
            await self.pool.stub(address).ReleaseSession(
                verifier_pb2.VerifierReleaseSessionRequest(session_id=session_id),
                timeout=self.config.verifier_call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                log.warning("could not release session %s at %s: %s", session_id, address, exc.details())

    def _info(self, entry: SessionEntry, held: verifier_pb2.VerifierSessionInfo | None) -> gateway_pb2.SessionInfo:
        idle = self.registry.idle_for(entry)
        info = gateway_pb2.SessionInfo(session=entry.handle, generating=entry.in_use > 0, idle_s=idle,
                                       expires_in_s=max(0.0, self.config.session_idle_ttl_s - idle))
        if held is not None:
            entry.tokens = held.num_tokens
            info.num_tokens, info.pages_used, info.pages_shared = held.num_tokens, held.pages_used, held.pages_shared
            info.generating |= held.generating
        return info

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)


def _scored(prompt: list[int], logprobs: Sequence[common_pb2.TokenLogprob], fresh: bool) -> gateway_pb2.PromptLogprobs:
    """The prompt's logprobs as the verifier computed them: every token's but, on a fresh session, the first's.
    NOTE: anything else is refused rather than handed on misaligned."""
    if len(logprobs) != len(prompt) - fresh:
        raise NoVerifier(f"the verifier scored {len(logprobs)} of the prompt's {len(prompt)} tokens; retry")
    return gateway_pb2.PromptLogprobs(token_ids=prompt, logprobs=logprobs)


def _capped(timeout: float | None, cap: float) -> float:
    return cap if timeout is None else min(timeout, cap)
