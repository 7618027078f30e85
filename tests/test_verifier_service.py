"""The verifier's generation loop without gRPC: it stays exact when no drafter answers and when a drafter
sends malformed trees (each costs one step of speculation and is counted)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import torch

from modeling.ops import use_device
from modeling.speculation import DraftStep
from modeling.tree import DraftTree
from proto import drafter_pb2, drafter_pb2_grpc
from tests.engine_helpers import GREEDY, make_engine, plain_generate
from verifier_service.drafter_messages import sized
from verifier_service.drafter_pool import DrafterPool, ReplicaLink
from verifier_service.metrics import VerifierMetrics
from verifier_service.service import PrefillEvent, VerifierService
from verifier_service.servicer import run_ahead
from verifier_service.step_loop import StepEvent
from verifier_service.worker import EngineWorker

PROMPT = list(b"no drafter, no problem")


class MalformedDrafters(DrafterPool):
    """A pool whose every tree names a parent after its child."""

    async def refresh(self) -> None:
        pass

    async def draft_all(self, steps: list[DraftStep]) -> list[DraftTree]:
        return [DraftTree((1, 2), (1, -1), (2, 1)) for _ in steps]


def generate(service: VerifierService) -> list[int]:
    async def run() -> list[int]:
        await service.start()
        try:
            session = await service.create_session(PROMPT)
            tokens = []
            async for event in service.generate(session.session_id, [], GREEDY, keep_session=False):
                tokens += event.result.emitted
            return tokens
        finally:
            await service.stop()
    return asyncio.run(run())


async def generated(service: VerifierService, session_id: str) -> list[int]:
    """A greedy generation's tokens, the session released after it."""
    return [t async for e in service.generate(session_id, [], GREEDY, False) if isinstance(e, StepEvent)
            for t in e.result.emitted]


def test_no_reachable_drafter_still_generates_exactly(tiny_target) -> None:
    engine = make_engine(tiny_target)
    metrics = VerifierMetrics()
    pool = DrafterPool("127.0.0.1:9", metrics, timeout_s=0.2)  # nothing listens on the discard port
    assert generate(VerifierService(engine, pool, metrics)) == plain_generate(engine, PROMPT)
    assert metrics.draft_misses._value.get() == GREEDY.max_new_tokens - 1  # the first step drafts nothing
    assert engine.pool.num_free == engine.pool.num_pages


def test_malformed_trees_are_counted_and_change_nothing(tiny_target) -> None:
    engine = make_engine(tiny_target)
    metrics = VerifierMetrics()
    assert generate(VerifierService(engine, MalformedDrafters("", metrics), metrics)) == plain_generate(engine, PROMPT)
    assert metrics.bad_trees._value.get() == GREEDY.max_new_tokens - 1  # the first step drafts nothing


def test_steps_run_on_the_loop_only_while_the_engine_thread_is_idle() -> None:
    async def main() -> None:
        worker, threaded = EngineWorker(), EngineWorker(inline_steps=False)
        here = threading.get_ident()
        assert await worker.step_call(threading.get_ident) == here
        assert await threaded.step_call(threading.get_ident) != here
        release = threading.Event()
        prefill = asyncio.ensure_future(worker.call(release.wait, 5))
        await asyncio.sleep(0.05)
        step = asyncio.ensure_future(worker.step_call(threading.get_ident))
        await asyncio.sleep(0.05)
        assert not step.done()  # queued behind the running call: never beside it
        release.set()
        assert await prefill and await step != here
        assert await worker.step_call(threading.get_ident) == here
        worker.shutdown()
        threaded.shutdown()

    asyncio.run(main())


class SilentDrafter(drafter_pb2_grpc.DrafterServicer):
    """Accepts the stream and every request, answers none of them."""

    async def Info(self, request, context):
        return drafter_pb2.DrafterInfoReply(replica_id="silent", drafter_kind="ngram")

    async def Draft(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        return
        yield  # NOTE: makes this a (reply-less) stream handler


def test_a_replica_that_never_answers_costs_one_timeout_then_is_probed() -> None:
    """The first step waits its timeout; later steps run without the replica at once, until a probe (Info)
    answers again. The silent replica answers Info, so it is back after one probe interval."""
    async def main() -> None:
        server = grpc.aio.server()
        drafter_pb2_grpc.add_DrafterServicer_to_server(SilentDrafter(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        metrics = VerifierMetrics()
        pool = DrafterPool(f"127.0.0.1:{port}", metrics, timeout_s=0.3, refresh_s=0.5)
        await pool.refresh()
        pool.attach("s", lambda: [1, 2, 3], None)
        waits = []
        for step in range(3):
            started = time.perf_counter()
            assert await pool.draft(DraftStep("s", step, [], None, 4, 3, 15)) is None
            waits.append(time.perf_counter() - started)
        assert waits[0] >= 0.3 and max(waits[1:]) < 0.1, waits
        assert metrics.drafter_stalls._value.get() == 1
        (link,) = pool.links.values()
        assert link.alive and not link.healthy and not link.waiting
        await asyncio.sleep(1.0)
        assert link.healthy and pool.usable_links() == [link]
        started = time.perf_counter()
        assert await pool.draft(DraftStep("s", 3, [], None, 4, 3, 15)) is None  # waits again: it is in use once more
        assert time.perf_counter() - started >= 0.3
        await pool.stop()
        await server.stop(None)

    asyncio.run(main())


def test_a_drafter_that_reads_features_gets_its_graphs_captured_before_the_first_step(tiny_target) -> None:
    """Start-up captures graphs that return no features (no replica answered); the drafter's layers arrive
    later and get theirs."""
    engine = make_engine(tiny_target)
    warmed = []
    engine.warm_up = lambda tokens, progress: warmed.append((engine.feature_layers, tokens)) or 3

    async def main() -> None:
        service = VerifierService(engine, DrafterPool("127.0.0.1:9", VerifierMetrics()), VerifierMetrics(),
                                  tree_budget=7)
        await service.start()
        info = drafter_pb2.DrafterInfoReply(target_layer_ids=[1, 2])
        service.drafters.on_info(info)  # what the pool calls when a replica connects
        service.drafters.on_info(info)  # the same layers again (another replica): nothing to capture
        await service.stop()

    asyncio.run(main())
    assert warmed == [((), 8), ((1, 2), 8)]


def test_a_long_appended_turn_reports_its_prefill_between_chunks_then_steps(tiny_target) -> None:
    """The engine prefills in chunks of 24 tokens ending at multiples of 24: a turn of 100 reports how far it got
    after each chunk but the last, before the first step, and the steps are those of the session prefilled in one
    go; a turn of one chunk reports nothing."""
    engine = make_engine(tiny_target)
    turn = [1 + i % 250 for i in range(100)]

    async def main() -> tuple[list, list]:
        service = VerifierService(engine, None, VerifierMetrics())
        await service.start()
        events = {}
        for name, append in (("long", turn), ("short", turn[:24])):
            session = await service.create_session(PROMPT)
            events[name] = [e async for e in service.generate(session.session_id, append, GREEDY, False)]
        await service.stop()
        return events["long"], events["short"]

    long, short = asyncio.run(main())
    first_chunk = 24 - (len(PROMPT) - 1) % 24  # 3: the session holds 21 positions
    reports = [PrefillEvent(done, 100) for done in range(first_chunk, 100, 24)]
    assert long[:len(reports)] == reports and len(reports) == 5
    assert all(isinstance(e, StepEvent) for e in long[len(reports):]) and all(isinstance(e, StepEvent) for e in short)
    assert [t for event in long[len(reports):] for t in event.result.emitted] == plain_generate(engine, PROMPT + turn)


def test_other_sessions_step_between_the_chunks_of_a_long_prefill(tiny_target) -> None:
    """A long prompt goes in one chunk per engine call: a session that is generating meanwhile keeps stepping
    between its chunks (rather than waiting for the whole prefill), and both outputs stay exact."""
    engine = make_engine(tiny_target)
    calls: list[str] = []
    step, prefill_chunk = engine.step, engine._prefill_chunk
    engine.step = lambda work: calls.append("step") or step(work)
    engine._prefill_chunk = lambda *args: calls.append("chunk") or prefill_chunk(*args)
    long_prompt = [1 + i % 250 for i in range(24 * 12)]

    async def main() -> tuple[list[int], list[int]]:
        service = VerifierService(engine, None, VerifierMetrics())
        await service.start()
        running = await service.create_session(PROMPT)
        calls.clear()

        async def prefill_then_decode() -> list[int]:
            await asyncio.sleep(0)  # NOTE: the other session is generating first
            return await generated(service, (await service.create_session(long_prompt)).session_id)

        outputs = await asyncio.gather(generated(service, running.session_id), prefill_then_decode())
        await service.stop()
        return outputs

    decoded, after_prefill = asyncio.run(main())
    chunks = [i for i, call in enumerate(calls) if call == "chunk"]
    assert len(chunks) == 12
    steps_within = [i for i, call in enumerate(calls) if call == "step" and chunks[0] < i < chunks[-1]]
    assert len(steps_within) >= 6  # NOTE: at most one step of the other session between two chunks
    assert decoded == plain_generate(engine, PROMPT) and after_prefill == plain_generate(engine, long_prompt)


def test_a_cancelled_prefill_and_a_lapsed_lease_release_their_sessions(tiny_target) -> None:
    """CreateSession's caller goes away mid-prefill: the prefill stops at its next chunk and nothing stays.
    A session nobody renews is released once its lease runs out; a renewed one stays."""
    engine = make_engine(tiny_target)
    forward = engine.forward
    engine.forward = lambda blocks: time.sleep(0.05) or forward(blocks)  # ~0.05 s per 24-token chunk

    async def main() -> None:
        service = VerifierService(engine, None, VerifierMetrics(), lease_s=0.6)
        await service.start()
        creating = asyncio.ensure_future(service.create_session(list(range(1, 250))))
        await asyncio.sleep(0.12)
        creating.cancel()
        await asyncio.gather(creating, return_exceptions=True)
        for _ in range(50):
            if not service.background:
                break
            await asyncio.sleep(0.02)
        assert not engine.sessions and engine.pool.num_free == engine.pool.num_pages
        kept, lapsed = [(await service.create_session(PROMPT)).session_id for _ in range(2)]
        for _ in range(8):
            assert service.renew_leases([kept, "no-such-session"]) == ["no-such-session"]
            await asyncio.sleep(0.2)
        assert set(engine.sessions) == {kept}
        await service.stop()

    asyncio.run(main())


def test_run_ahead_stops_producing_when_the_stream_stops_reading() -> None:
    produced = []

    async def steps():
        for i in range(100):
            produced.append(i)
            yield i

    async def main() -> None:
        events = run_ahead(steps(), limit=3)
        assert await anext(events) == 0
        await asyncio.sleep(0.05)  # the reader stalls: the producer may run `limit` events ahead, no more
        assert len(produced) == 1 + 3 + 1  # read, held in the queue, and the one waiting for room
        assert [e async for e in events] == list(range(1, 100))

    asyncio.run(main())


class RecordingCall:
    """A Draft stream that records each write's kind and whether the loop had turned since the round began; with
    `stuck`, no write ever completes (a replica that has stopped reading)."""

    def __init__(self, turned: list[bool], stuck: bool = False):
        self.turned, self.stuck, self.writes = turned, stuck, []

    async def write(self, request: drafter_pb2.DrafterRequest) -> None:
        self.writes.append((request.WhichOneof("kind"), self.turned[0]))
        if self.stuck:
            await asyncio.Event().wait()


def draft_round(stuck: bool = False, timeout_s: float = 0.05) -> tuple[list, list, float]:
    """Two sessions' first draft round through a pool whose one link writes to a RecordingCall: (the writes, the
    trees, the round's seconds)."""

    async def main() -> tuple[list, list, float]:
        pool = DrafterPool("127.0.0.1:9", VerifierMetrics(), timeout_s=timeout_s, refresh_s=60.0)
        link = ReplicaLink("127.0.0.1:9", lambda session_id: None, lambda: None)
        link.alive, link.info = True, drafter_pb2.DrafterInfoReply(batches=True, max_sessions=8)
        turned = [False]
        call = link.call = RecordingCall(turned, stuck)
        pool.links[link.address] = link
        for session_id in ("a", "b"):
            pool.attach(session_id, lambda: [1, 2, 3], None)
        asyncio.get_running_loop().call_soon(turned.__setitem__, 0, True)
        started = time.perf_counter()
        trees = await pool.draft_all([DraftStep(session_id, 0, [], None, 4, 3, 15) for session_id in ("a", "b")])
        seconds = time.perf_counter() - started
        link.call = None  # NOTE: nothing to half-close
        await pool.stop()
        return call.writes, trees, seconds

    return asyncio.run(main())


def test_a_draft_round_writes_its_requests_itself_before_the_loop_turns(monkeypatch) -> None:
    """The round's requests go out from draft_all's own coroutine, in one batch message: handed to a writer task,
    they waited a turn of the loop behind whatever else was ready, inside every decode step. What does not fit one
    message (a seed's features) is left to the writer task, whose write may outlast the round."""
    assert draft_round()[0] == [("batch", False)]  # NOTE: both Opens and both steps, before the loop turned
    monkeypatch.setattr("verifier_service.drafter_pool.BATCH_BYTES", 1)
    assert [turned for _, turned in draft_round()[0]] == [True] * 4


def test_a_round_whose_replica_takes_no_write_ends_at_its_deadline() -> None:
    """A replica that has stopped reading holds the round's write: the round still ends at its deadline, without
    trees (the write is cancelled, which ends the replica's stream in gRPC)."""
    writes, trees, seconds = draft_round(stuck=True, timeout_s=0.1)
    assert writes == [("batch", False)] and trees == [None, None] and seconds < 0.5


def test_a_replica_whose_stream_stopped_taking_requests_is_stalled_not_queued_to(monkeypatch) -> None:
    """The requests waiting for one replica's stream are bounded: once full, a step runs without that replica at
    once (no timeout to wait) and the replica is marked as stalled."""
    monkeypatch.setattr("verifier_service.drafter_pool.OUTBOX_LIMIT", 4)

    async def main() -> None:
        metrics = VerifierMetrics()
        pool = DrafterPool("127.0.0.1:9", metrics, timeout_s=5.0, refresh_s=60.0)
        link = ReplicaLink("127.0.0.1:9", lambda session_id: None, lambda: None)
        link.alive = True  # as if its stream were open, but nothing reads the outbox
        pool.links[link.address] = link
        pool.attach("s", lambda: [1, 2, 3], None)
        for _ in range(4):
            link.send(sized(drafter_pb2.DrafterRequest()))
        started = time.perf_counter()
        assert await pool.draft(DraftStep("s", 0, [], None, 4, 3, 15)) is None
        assert time.perf_counter() - started < 0.5 and len(link.outbox) == 4
        assert not link.healthy and metrics.drafter_stalls._value.get() == 1
        await pool.stop()

    asyncio.run(main())


def test_the_engine_thread_and_a_cuda_index_make_the_engines_device_current(monkeypatch) -> None:
    """Triton launches on the calling thread's current device, not on its tensors': an engine on cuda:1 must have
    cuda:1 current in the thread that runs it (a thread starts on device 0)."""
    current: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append((threading.current_thread().name,
                                                                                 device)))
    for device in ("cpu", "cuda"):  # NOTE: nothing to set: the CPU, or device 0 already
        use_device(device)
    assert current == []
    use_device("cuda:1")
    assert current == [(threading.current_thread().name, torch.device("cuda:1"))]

    async def main() -> None:
        worker = EngineWorker(inline_steps=False, device="cuda:2")
        name = await worker.call(lambda: threading.current_thread().name)
        worker.shutdown()
        assert current[-1] == (name, torch.device("cuda:2")) and name.startswith("engine")

    asyncio.run(main())


def test_a_lone_prompt_prefills_in_lone_chunks_and_one_beside_a_generation_in_short_ones(tiny_target) -> None:
    """--lone-prefill-chunk 96 (the engine's chunk is 24): with nobody else waiting for the engine a prompt goes in
    chunks of 96 ending at multiples of 96; while another session generates, in chunks of 24, so that session steps
    between short chunks; every output stays exact."""
    engine = make_engine(tiny_target, lone_prefill_chunk=96, prefix_caching=False)  # NOTE: one prompt twice
    sizes: list[int] = []
    prefill_chunk = engine._prefill_chunk
    engine._prefill_chunk = lambda table, tokens, start, *rest: (sizes.append(rest[0] - start)
                                                                 or prefill_chunk(table, tokens, start, *rest))
    long_prompt = [1 + i % 250 for i in range(24 * 12)]  # NOTE: 287 positions to prefill

    async def main() -> tuple[list[int], list[int], list[int]]:
        service = VerifierService(engine, None, VerifierMetrics())
        await service.start()
        alone = await service.create_session(long_prompt)
        lone_sizes = list(sizes)
        sizes.clear()
        await service.release_session(alone.session_id)
        running = await service.create_session(PROMPT)
        sizes.clear()

        async def prefill_then_decode() -> list[int]:
            while not service.loop.steppers:  # NOTE: the other session is generating first
                await asyncio.sleep(0.001)
            return await generated(service, (await service.create_session(long_prompt)).session_id)

        decoded, after_prefill = await asyncio.gather(generated(service, running.session_id), prefill_then_decode())
        await service.stop()
        return lone_sizes, decoded, after_prefill

    lone_sizes, decoded, after_prefill = asyncio.run(main())
    assert lone_sizes == [96, 96, 95]
    assert sizes[:6] == [24] * 6 and sum(sizes) == 287  # NOTE: lone chunks again once the generation has ended
    assert decoded == plain_generate(engine, PROMPT) and after_prefill == plain_generate(engine, long_prompt)


def test_a_release_whose_caller_is_cancelled_while_it_waits_still_happens(tiny_target) -> None:
    """A generation's caller goes away, and its task is cancelled once more while its session's release waits behind
    other engine work (its deadline firing then, or the stream ending); a ReleaseSession's caller gives up while it
    waits: the releases still run, so no KV page stays held (the sessions' leases are gone by then: nothing else
    would free them)."""
    engine = make_engine(tiny_target)

    async def main() -> None:
        service = VerifierService(engine, None, VerifierMetrics())
        await service.start()
        session = await service.create_session(PROMPT)
        stepped = asyncio.Event()

        async def consume() -> None:
            # NOTE: closed by this task, as the GenerateStream's own task closes a generation
            async with contextlib.aclosing(service.generate(session.session_id, [], GREEDY, False)) as events:
                async for event in events:
                    if isinstance(event, StepEvent):
                        stepped.set()
                        await asyncio.sleep(10)  # NOTE: the caller stops reading here

        generation = asyncio.ensure_future(consume())
        await stepped.wait()
        busy = service.worker.submit(time.sleep, 0.3)  # NOTE: the release will wait behind this on the engine thread
        generation.cancel()
        await asyncio.sleep(0.05)
        generation.cancel()
        await asyncio.gather(generation, busy, return_exceptions=True)
        for _ in range(50):
            if not engine.sessions:
                break
            await asyncio.sleep(0.02)
        assert not engine.sessions and engine.pool.num_free == engine.pool.num_pages

        kept = await service.create_session(PROMPT)  # NOTE: a ReleaseSession whose caller's deadline passes
        busy = service.worker.submit(time.sleep, 0.3)
        releasing = asyncio.ensure_future(service.release_session(kept.session_id))
        await asyncio.sleep(0.05)
        releasing.cancel()
        await asyncio.gather(releasing, busy, return_exceptions=True)
        await asyncio.gather(*service.background)
        assert not engine.sessions and engine.pool.num_free == engine.pool.num_pages
        await service.stop()

    asyncio.run(main())
