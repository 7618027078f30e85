"""The Verifier gRPC servicer: proto in, one domain call, proto out; errors mapped in one place."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc

from proto import common_pb2, verifier_pb2, verifier_pb2_grpc
from proto.status import maps_status
from verifier_service.engine.logprobs import TokenLogprob
from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.session import Session
from verifier_service.engine.stopping import StopReason
from verifier_service.generation_stream import RUN_AHEAD_EVENTS, StreamSlot, serve_generations
from verifier_service.service import PrefillEvent, PromptLogprobsEvent, VerifierService
from verifier_service.step_loop import StepEvent

T = TypeVar("T")

DEFAULT_MAX_NEW_TOKENS = 256

# NOTE: the verifier's own errors name their status (verifier_service/errors.py); a stray ValueError (a bad
# tree, a bad field deep in the engine) is the caller's fault, and a stray KeyError an unknown session.
FALLBACKS = ((ValueError, grpc.StatusCode.INVALID_ARGUMENT), (KeyError, grpc.StatusCode.NOT_FOUND))
maps_errors = maps_status(fallbacks=FALLBACKS)

STOP_REASONS = {
    StopReason.LENGTH: common_pb2.STOP_REASON_LENGTH,
    StopReason.STOP_TOKEN: common_pb2.STOP_REASON_STOP_TOKEN,
    StopReason.STOP_STRING: common_pb2.STOP_REASON_STOP_STRING,
    StopReason.CONTEXT_LIMIT: common_pb2.STOP_REASON_CONTEXT_LIMIT,
}


def params_from_pb(params: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p or 1.0,
        seed=params.seed if params.HasField("seed") else None,
        max_new_tokens=params.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        stop_token_ids=tuple(params.stop_token_ids),
        stop_strings=tuple(params.stop_strings),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=tuple(sorted(params.logit_bias.items())),
    )


def logprobs_pb(logprobs: list[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs,
                                    rank=lp.rank or 0) for lp in logprobs or ()]


def prompt_logprobs_of(request: verifier_pb2.VerifierCreateSessionRequest | verifier_pb2.VerifierGenerateRequest
                       ) -> int | None:
    """The request's prompt_logprobs (alternatives), None when unset."""
    return request.prompt_logprobs if request.HasField("prompt_logprobs") else None


async def run_ahead(events: AsyncIterator[T], limit: int = RUN_AHEAD_EVENTS) -> AsyncIterator[T]:
    """The events of `events`, produced by a task of their own: the next step starts while the stream still
    writes this one (a write waits for the transport, and that wait would otherwise sit inside every step), at most
    `limit` events ahead. Closing this iterator cancels the producer and waits for it, so its cleanup has run
    when we return."""
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(limit)

    async def produce() -> None:
        try:
            async for event in events:
                await room.acquire()
                queue.put_nowait((event, None))
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait((None, error))
            if isinstance(error, asyncio.CancelledError):
                raise
        else:
            queue.put_nowait((None, None))

    producer = asyncio.create_task(produce())
    try:
        while True:
            event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                return
            room.release()
            yield event
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


def _prefill_pb(event: PrefillEvent | PromptLogprobsEvent) -> verifier_pb2.VerifierGenerateStep:
    if isinstance(event, PromptLogprobsEvent):
        return verifier_pb2.VerifierGenerateStep(prompt_logprobs=logprobs_pb(event.logprobs))
    return verifier_pb2.VerifierGenerateStep(
        prefill=common_pb2.PrefillProgress(prefilled_tokens=event.done, total_tokens=event.total,
                                           cached_tokens=event.cached))


class _SlotSink:
    """A generation's steps, converted by the step loop itself, straight into its GenerateStream slot."""

    def __init__(self, servicer: VerifierServicer, slot: StreamSlot):
        self.to_pb, self.slot = servicer._step_pb, slot

    def put(self, event: StepEvent) -> None:
        self.slot.put(self.to_pb(event))

    def has_room(self) -> bool:
        return self.slot.has_room()


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, service: VerifierService, model_name: str):
        self.service, self.model_name = service, model_name

    def _session_pb(self, session: Session) -> verifier_pb2.VerifierSessionInfo:
        pool = self.service.engine.pool
        return verifier_pb2.VerifierSessionInfo(
            session_id=session.session_id, num_tokens=len(session.tokens), prefix_length=session.kv_len,
            pages_used=len(session.block_table.pages),
            pages_shared=sum(pool.is_shared(p) for p in session.block_table.pages),
            generating=session.session_id in self.service.generating)

    @maps_errors
    async def CreateSession(self, request, context):
        started = time.perf_counter()
        session, logprobs = await self.service.prefill_session(list(request.prompt_token_ids),
                                                               prompt_logprobs_of(request))
        return verifier_pb2.VerifierCreateSessionReply(session=self._session_pb(session),
                                                       prefill_ms=(time.perf_counter() - started) * 1e3,
                                                       prompt_logprobs=logprobs_pb(logprobs),
                                                       cached_tokens=session.cached_tokens)

    @maps_errors
    async def Generate(self, request, context):
        async for step in run_ahead(self._generation(request)):
            yield step

    async def GenerateStream(self, request_iterator, context):
        async for reply in serve_generations(
                request_iterator, lambda message, slot: self._generation(message.generate, _SlotSink(self, slot)),
                FALLBACKS, self.service.loop.wake):
            yield reply

    async def _generation(self, request: verifier_pb2.VerifierGenerateRequest, sink: _SlotSink | None = None
                          ) -> AsyncIterator[verifier_pb2.VerifierGenerateStep]:
        """The generation's messages: all of them, or, given a sink, the prefill's (the steps go into the sink)."""
        params = params_from_pb(request.params)
        events = self.service.generate(request.session_id, list(request.append_token_ids), params,
                                       request.keep_session, request.tree_budget, sink, prompt_logprobs_of(request))
        async with contextlib.aclosing(events):
            async for event in events:
                yield self._step_pb(event) if isinstance(event, StepEvent) else _prefill_pb(event)

    def _step_pb(self, event: StepEvent) -> verifier_pb2.VerifierGenerateStep:
        result = event.result
        return verifier_pb2.VerifierGenerateStep(
            step=event.step, token_ids=result.emitted,
            acceptance_length=result.acceptance_length, drafted_nodes=event.drafted_nodes,
            finished=result.finished is not None,
            stop_reason=STOP_REASONS.get(result.finished, common_pb2.STOP_REASON_UNSPECIFIED),
            # NOTE: from the step itself: the engine may be running the session's next burst already (StepLoop._burst)
            num_tokens=result.commit_start + len(result.committed) + 1,
            timings=common_pb2.StepTimings(draft_wait_ms=event.draft_wait_s * 1e3, verify_ms=event.verify_s * 1e3),
            logprobs=logprobs_pb(result.logprobs))

    @maps_errors
    async def ForkSession(self, request, context):
        return self._session_pb(await self.service.fork_session(request.session_id))

    @maps_errors
    async def ReleaseSession(self, request, context):
        return verifier_pb2.VerifierReleaseSessionReply(pages_freed=await self.service.release_session(
            request.session_id))

    @maps_errors
    async def GetSession(self, request, context):
        return self._session_pb(self.service.session(request.session_id))

    @maps_errors
    async def RenewLeases(self, request, context):
        return verifier_pb2.VerifierRenewLeasesReply(
            unknown_session_ids=self.service.renew_leases(list(request.session_ids)))

    @maps_errors
    async def Info(self, request, context):
        engine = self.service.engine
        return verifier_pb2.VerifierInfoReply(
            model_name=self.model_name, page_size=engine.config.page_size,
            kv_capacity_pages=engine.pool.num_pages, free_pages=engine.pool.num_free,
            max_context=engine.max_context, vocab_size=engine.model_config.vocab_size,
            eos_token_ids=list(engine.model_config.eos_token_ids), active_sessions=len(engine.sessions),
            max_tree_nodes=engine.config.max_tree_nodes, session_lease_s=self.service.leases.lease_s,
            dtype=str(engine.config.torch_dtype).removeprefix("torch."), device=str(engine.device),
            cuda_graphs=len(engine.graphs.graphs) if engine.graphs is not None else 0,
            drafters_connected=len(self.service.drafters.usable_links()) if self.service.drafters else 0,
            room_pages=max(0, engine.room()), waiting_requests=self.service.admission.waiting)
