"""The drafter servicer's two paths: a step that finds the drafter idle is drafted by its stream's reader and
answered at once; steps that arrive while replies are being written queue and form one batch (a newer step
absorbs its session's older one). Errors stay per session on both paths; a stream that ends closes its sessions.

Most tests drive `Draft` with in-process streams whose writes can be held back (deterministic); one runs the
servicer behind real gRPC with the verifier's DrafterPool."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
import torch

from drafter_service.dflash_drafter import DFlashDrafter
from drafter_service.ngram_drafter import NgramDrafter
from drafter_service.servicer import DrafterServicer, _message, _step_from_pb, _Stream, _TreeReply
from modeling.speculation import DrafterSeed, DraftStep
from modeling.tree import DraftTree
from proto import common_pb2, drafter_pb2, drafter_pb2_grpc
from proto.tensors import from_proto
from tests.test_dflash import assert_same_tree, load
from verifier_service.drafter_messages import close_request, open_request, step_request, tree_from_reply
from verifier_service.drafter_pool import DrafterPool, FeatureWindow, ReplicaLink
from verifier_service.metrics import VerifierMetrics

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
SCHEDULER = "draft-scheduler"


class RecordingDrafter(NgramDrafter):
    """The n-gram drafter, noting which task drafted which sessions together and which mirrors it opened;
    `failing` sessions raise."""

    def __init__(self, failing: tuple[str, ...] = ()):
        super().__init__()
        self.batches: list[tuple[str, list[str]]] = []
        self.failing = set(failing)
        self.opens: list[str] = []

    def open(self, session_id: str, seed: DrafterSeed) -> None:
        self.opens.append(session_id)
        super().open(session_id, seed)

    def draft(self, steps: list[DraftStep]):
        self.batches.append((asyncio.current_task().get_name(), [s.session_id for s in steps]))
        if self.failing.intersection(s.session_id for s in steps):
            raise RuntimeError("boom")
        return super().draft(steps)


class FakeStream:
    """One verifier stream in process: requests fed from a queue, writes held until `release()` when gated."""

    def __init__(self, servicer: DrafterServicer, gated: bool = False):
        self.inbox: asyncio.Queue[drafter_pb2.DrafterRequest | None] = asyncio.Queue()
        self.replies: list[drafter_pb2.DrafterReply] = []
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.task = asyncio.create_task(servicer.Draft(self._requests(), self))

    async def _requests(self):
        while (request := await self.inbox.get()) is not None:
            yield request

    async def write(self, reply: drafter_pb2.DrafterReply) -> None:  # the ServicerContext's write
        await self.gate.wait()
        self.replies.append(reply)

    def open(self, session_id: str, tokens: list[int] = PROMPT, features: common_pb2.Tensor | None = None) -> None:
        self.inbox.put_nowait(drafter_pb2.DrafterRequest(open=drafter_pb2.DrafterOpen(
            session_id=session_id, token_ids=tokens, features=features)))

    def step(self, session_id: str, step: int, committed: list[int], root: int, position: int,
             features: common_pb2.Tensor | None = None) -> None:
        self.inbox.put_nowait(drafter_pb2.DrafterRequest(step=drafter_pb2.DrafterStep(
            session_id=session_id, step=step, committed_token_ids=committed, root_token_id=root,
            position=position, tree_budget=8, features=features)))

    def release(self) -> None:
        self.gate.set()

    def end(self) -> None:
        self.inbox.put_nowait(None)

    def by_session(self) -> dict[str, drafter_pb2.DrafterReply]:
        return {getattr(r, r.WhichOneof("kind")).session_id: r for r in self.replies}


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def reference_tree(history: list[int]) -> tuple[int, ...]:
    """The n-gram tree under history[-1], drafted in process."""
    drafter = NgramDrafter()
    drafter.open("s", DrafterSeed(history[:-1], None, 0))
    return drafter.draft([DraftStep("s", 0, [], None, history[-1], len(history) - 1, 8)])[0].tokens


def error_code(reply: drafter_pb2.DrafterReply) -> grpc.StatusCode:
    assert reply.WhichOneof("kind") == "error", reply
    return next(code for code in grpc.StatusCode if code.value[0] == reply.error.code)


def run(test) -> None:
    async def main() -> None:
        drafter = RecordingDrafter(failing=("z",))
        servicer = DrafterServicer(drafter, "r0")
        servicer.start()
        try:
            await test(servicer, drafter)
        finally:
            servicer.task.cancel()
    asyncio.run(main())


def test_an_idle_drafter_drafts_in_the_reader_and_answers_at_once() -> None:
    async def test(servicer: DrafterServicer, drafter: RecordingDrafter) -> None:
        stream = FakeStream(servicer)
        stream.open("a")
        stream.step("a", 0, [], 5, len(PROMPT))
        stream.step("a", 1, [5], 6, len(PROMPT))
        await settle()
        assert [name for name, _ in drafter.batches] == [stream.task.get_name()] * 2  # never the scheduler
        assert [r.tree.step for r in stream.replies] == [0, 1]
        assert stream.replies[1].tree.tree.tokens == list(reference_tree(PROMPT + [5, 6]))
        stream.end()
        await stream.task
    run(test)


def test_steps_arriving_while_a_reply_is_written_form_one_batch() -> None:
    async def test(servicer: DrafterServicer, drafter: RecordingDrafter) -> None:
        first, second = FakeStream(servicer, gated=True), FakeStream(servicer)
        first.open("a")
        first.step("a", 0, [], 5, len(PROMPT))
        await settle()
        assert drafter.batches == [(first.task.get_name(), ["a"])] and not first.replies  # its reply is held
        second.open("b")
        second.open("c")
        second.step("b", 0, [], 5, len(PROMPT))
        second.step("c", 0, [], 6, len(PROMPT))
        second.step("b", 1, [5], 7, len(PROMPT))  # absorbs b's queued step 0
        await settle()
        assert drafter.batches[1:] == [(SCHEDULER, ["b", "c"])]
        replies = second.by_session()
        assert len(second.replies) == 2 and replies["b"].tree.step == 1 and replies["c"].tree.step == 0
        assert replies["b"].tree.tree.tokens == list(reference_tree(PROMPT + [5, 7]))
        first.release()
        await settle()
        assert [r.tree.step for r in first.replies] == [0]
        second.end()
        first.end()
        await asyncio.gather(first.task, second.task)
    run(test)


def test_errors_stay_with_their_session_on_both_paths() -> None:
    async def test(servicer: DrafterServicer, drafter: RecordingDrafter) -> None:
        malformed = common_pb2.Tensor(dtype="float32", shape=[2], data=b"abc")
        stream = FakeStream(servicer)
        stream.step("ghost", 3, [], 5, 0)  # idle: the reader drafts it and answers NOT_FOUND itself
        stream.step("ghost", 4, [], 5, 0, features=malformed)
        stream.open("bad", features=malformed)
        await settle()
        assert [error_code(r) for r in stream.replies] == [grpc.StatusCode.NOT_FOUND,
                                                           grpc.StatusCode.INVALID_ARGUMENT,
                                                           grpc.StatusCode.INVALID_ARGUMENT]
        assert [r.error.step for r in stream.replies] == [3, 4, 0]

        busy, batched = FakeStream(servicer, gated=True), FakeStream(servicer)
        busy.open("a")
        busy.step("a", 0, [], 5, len(PROMPT))
        for session_id in ("y", "z", "w"):
            batched.open(session_id)
        batched.step("ghost", 1, [], 5, 0)
        batched.step("y", 1, [], 5, len(PROMPT) + 3)  # past the history
        batched.step("z", 1, [], 5, len(PROMPT))  # the drafter raises
        batched.step("w", 1, [], 5, len(PROMPT))
        await settle()
        assert drafter.batches[-5] == (SCHEDULER, ["ghost", "y", "z", "w"])  # then one at a time
        replies = batched.by_session()
        assert {s: error_code(replies[s]) for s in ("ghost", "y", "z")} == {
            "ghost": grpc.StatusCode.NOT_FOUND, "y": grpc.StatusCode.INVALID_ARGUMENT,
            "z": grpc.StatusCode.INTERNAL}
        assert replies["w"].tree.tree.tokens == list(reference_tree(PROMPT + [5]))
        busy.release()
        for each in (stream, busy, batched):
            each.end()
        await asyncio.gather(stream.task, busy.task, batched.task)
    run(test)


def test_an_ended_stream_sends_its_replies_then_closes_its_sessions() -> None:
    async def test(servicer: DrafterServicer, drafter: RecordingDrafter) -> None:
        busy, ending = FakeStream(servicer, gated=True), FakeStream(servicer, gated=True)
        busy.open("a")
        busy.step("a", 0, [], 5, len(PROMPT))
        ending.open("b")
        ending.open("c")
        ending.step("b", 0, [], 5, len(PROMPT))
        await settle()
        assert drafter.batches[-1] == (SCHEDULER, ["b"]) and not ending.replies  # its reply is held
        ending.end()
        await settle()
        assert not ending.task.done()
        ending.release()
        await ending.task
        assert [r.tree.step for r in ending.replies] == [0]
        assert "b" not in drafter.ngram and "c" not in drafter.ngram and servicer.open_ids == {"a"}
        busy.release()
        busy.end()
        await busy.task
        assert not servicer.open_ids and not servicer.streams
    run(test)


async def serve(servicer: DrafterServicer) -> tuple[grpc.aio.Server, DrafterPool]:
    """The servicer behind real gRPC on loopback, and a verifier's pool pointed at it."""
    server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.start()
    await server.start()
    return server, DrafterPool(f"127.0.0.1:{port}", VerifierMetrics(), timeout_s=5.0)


@contextlib.asynccontextmanager
async def connected_pool(servicer: DrafterServicer) -> AsyncIterator[tuple[DrafterPool, ReplicaLink]]:
    """The servicer behind real gRPC on loopback, and a verifier's pool connected to it (its one link)."""
    server, pool = await serve(servicer)
    try:
        await pool.refresh()
        yield pool, next(iter(pool.links.values()))
    finally:
        await pool.stop()
        servicer.task.cancel()
        await server.stop(None)


def test_the_verifier_pool_drafts_over_grpc_and_its_sessions_close_with_the_stream() -> None:
    async def main() -> None:
        drafter = RecordingDrafter()
        servicer = DrafterServicer(drafter, "r0")
        async with connected_pool(servicer) as (pool, _):
            pool.attach("s", lambda: PROMPT, None)
            history = list(PROMPT)
            for step, (committed, root) in enumerate([([], 5), ([5], 6), ([6], 7)]):
                tree = await pool.draft(DraftStep("s", step, committed, None, root, len(PROMPT) + max(0, step - 1), 8))
                history.append(root)
                assert tree.tokens == reference_tree(history)
            assert SCHEDULER not in {name for name, _ in drafter.batches} and len(drafter.batches) == 3
            assert histogram(pool.metrics, "ddtree_verifier_drafter_compute_seconds")[0] == 3  # one per round
            assert servicer.open_ids == {"s"}
            await pool.stop()
            for _ in range(100):
                if not servicer.open_ids:
                    break
                await asyncio.sleep(0.01)
            assert not servicer.open_ids and "s" not in drafter.ngram
    asyncio.run(main())


def test_a_seed_sent_ahead_is_acknowledged_and_the_session_is_opening_until_then() -> None:
    """`open_soon` sends the seed before any draft; a replica that acknowledges Opens answers once the mirror is
    ready, and the session is `opening` until then (its steps go without drafts). Without acknowledgements (an
    older replica) the session counts as open at once: its first draft goes behind the seed."""
    async def main(acks: bool) -> tuple[bool, bool, int]:
        servicer = DrafterServicer(RecordingDrafter(), "r0")
        async with connected_pool(servicer) as (pool, link):
            link.info.open_acks = acks
            pool.attach("s", lambda: PROMPT, None)
            pool.open_soon("s")
            opening_at_once = pool.opening("s")
            for _ in range(200):
                if not pool.opening("s"):
                    break
                await asyncio.sleep(0.01)
            tree = await pool.draft(DraftStep("s", 0, [], None, 5, len(PROMPT), 8))
            assert tree.tokens == reference_tree(PROMPT + [5]) and servicer.open_ids == {"s"}
            return opening_at_once, pool.opening("s"), histogram(pool.metrics, "ddtree_verifier_seed_seconds")[0]

    assert asyncio.run(main(True)) == (True, False, 1)
    assert asyncio.run(main(False)) == (False, False, 0)


def test_an_open_unacknowledged_past_the_patience_or_on_a_lost_replica_holds_no_draft_back(monkeypatch) -> None:
    """A replica that never acknowledges (or is gone) must not keep a session plain for good: past
    OPEN_ACK_PATIENCE_S its steps go behind the Open, and a lost replica's session re-seeds at its next draft."""
    async def main() -> None:
        async with connected_pool(DrafterServicer(RecordingDrafter(), "r0")) as (pool, link):
            pool.attach("s", lambda: PROMPT, None)
            pool.open_soon("s")
            assert pool.opening("s")
            monkeypatch.setattr("verifier_service.drafter_pool.OPEN_ACK_PATIENCE_S", 0.0)
            assert not pool.opening("s")
            monkeypatch.undo()
            pool.sessions["s"].opening = 1e18  # NOTE: as if still waiting for the acknowledgement
            link.alive = False
            assert not pool.opening("s") and not pool.is_open("s")

    asyncio.run(main())


def test_a_session_is_seeded_only_where_a_replica_has_room_for_its_mirror() -> None:
    """A replica full of mirrors (its Info's max_sessions) gets no Open: one would fail, and the session's next step
    would send its seed again, every step (42 MB each for a DFlash drafter). The session steps without drafts until
    a mirror closes, then seeds."""
    async def main() -> None:
        servicer = DrafterServicer(RecordingDrafter(), "r0")
        async with connected_pool(servicer) as (pool, link):
            link.info.max_sessions = 1
            for session_id in ("a", "b"):
                pool.attach(session_id, lambda: PROMPT, None)
                pool.open_soon(session_id)
            assert link.mirrors == {"a"} and not pool.is_open("b")
            assert await pool.draft(DraftStep("b", 0, [], None, 5, len(PROMPT), 8)) is None
            assert link.mirrors == {"a"} and servicer.open_ids <= {"a"}  # NOTE: no Open went out for b
            pool.detach("a")
            tree = await pool.draft(DraftStep("b", 1, [], None, 5, len(PROMPT), 8))
            assert tree.tokens == reference_tree(PROMPT + [5]) and link.mirrors == {"b"}

    asyncio.run(main())


def test_a_parked_mirror_takes_the_next_turn_without_a_seed() -> None:
    """A session's mirror stays open between its turns: the next turn's first draft carries the tokens the mirror
    has not seen (the last turn's tail, which no draft carried, and the new prompt) in front of its own, no Open
    goes out, and its tree is the one a fresh seed would give."""
    async def main() -> None:
        drafter = RecordingDrafter()
        async with connected_pool(DrafterServicer(drafter, "r0")) as (pool, _):
            tokens = list(PROMPT)
            pool.attach("s", lambda: tokens, None)
            first = await pool.draft(DraftStep("s", 0, [], None, 5, len(tokens), 8))
            assert first.tokens == reference_tree(tokens + [5])
            tokens += [5, 6, 7]  # NOTE: the root and two tokens more, stepped without drafts; the turn ends
            pool.park("s")
            tokens += [8, 5, 6]  # the next turn's prompt, prefilled
            tree = await pool.draft(DraftStep("s", 0, [], None, 7, len(tokens), 8))
            assert tree.tokens == reference_tree(tokens + [7]) and len(tree.tokens) > 0
            assert drafter.opens == ["s"] and pool.metrics.mirror_resumes._value.get() == 1

    asyncio.run(main())


def test_a_full_replica_closes_the_mirror_parked_longest_for_a_new_session() -> None:
    """Parked mirrors hold a replica's slots while their sessions are between turns: a session that needs one on a
    full replica takes the slot of the mirror parked longest, whose next turn seeds again."""
    async def main() -> None:
        drafter = RecordingDrafter()
        async with connected_pool(DrafterServicer(drafter, "r0")) as (pool, link):
            link.info.max_sessions = 2
            for session_id in ("a", "b"):
                pool.attach(session_id, lambda: PROMPT, None)
                assert await pool.draft(DraftStep(session_id, 0, [], None, 5, len(PROMPT), 8)) is not None
                pool.park(session_id)
            pool.attach("c", lambda: PROMPT, None)
            assert await pool.draft(DraftStep("c", 0, [], None, 5, len(PROMPT), 8)) is not None
            assert link.mirrors == {"b", "c"} and pool.metrics.mirror_evictions._value.get() == 1
            tree = await pool.draft(DraftStep("a", 1, [], None, 5, len(PROMPT), 8))  # its next turn
            assert tree.tokens == reference_tree(PROMPT + [5]) and link.mirrors == {"a", "c"}
            assert drafter.opens == ["a", "b", "c", "a"]

    asyncio.run(main())


def test_a_verifier_that_stops_reading_stops_the_reader_not_the_memory(monkeypatch) -> None:
    """Replies for a stream whose writes hang are bounded: past the limit the reader takes no more requests,
    so gRPC flow control holds the verifier back; everything is answered once writes resume."""
    monkeypatch.setattr("drafter_service.servicer.PENDING_REPLIES_LIMIT", 2)

    async def test(servicer: DrafterServicer, drafter: RecordingDrafter) -> None:
        stream = FakeStream(servicer, gated=True)
        sessions = [f"s{i}" for i in range(6)]
        for session_id in sessions:
            stream.open(session_id)
        for step in range(4):
            for session_id in sessions:
                stream.step(session_id, step, [5] if step else [], 5, len(PROMPT) + max(0, step - 1))
                await settle()
        (held,) = (s for s in servicer.streams)
        assert len(held.pending) <= 2 + len(sessions) and stream.inbox.qsize() > 0
        stream.release()
        await settle()
        assert stream.inbox.qsize() == 0 and not held.pending
        assert {r.tree.session_id for r in stream.replies if r.tree.step == 3} == set(sessions)
        stream.end()
        await stream.task
    run(test)


def test_a_batch_of_requests_is_drafted_together_and_answered_in_one_message() -> None:
    """Opens, steps and a close in one message: handled in order, the steps drafted together by the reader, their
    replies sent back as one batch (a stream that never sent a batch gets one message per reply, as above)."""
    async def test(servicer: DrafterServicer, drafter: RecordingDrafter) -> None:
        stream = FakeStream(servicer)
        batch = [drafter_pb2.DrafterRequest(open=drafter_pb2.DrafterOpen(session_id=s, token_ids=PROMPT))
                 for s in ("a", "b", "gone")]
        batch += [drafter_pb2.DrafterRequest(close=drafter_pb2.DrafterClose(session_id="gone"))]
        batch += [drafter_pb2.DrafterRequest(step=drafter_pb2.DrafterStep(
            session_id=s, step=1, root_token_id=root, position=len(PROMPT), tree_budget=8))
            for s, root in (("a", 5), ("b", 6), ("gone", 5))]
        stream.inbox.put_nowait(drafter_pb2.DrafterRequest(batch=drafter_pb2.DrafterRequests(requests=batch)))
        await settle()
        # together, then one at a time to isolate the session at fault (gone: its mirror was closed)
        assert drafter.batches[0] == (stream.task.get_name(), ["a", "b", "gone"]) and len(drafter.batches) == 4
        (message,) = stream.replies
        a, b, gone = message.batch.replies
        assert a.tree.tree.tokens == list(reference_tree(PROMPT + [5]))
        assert b.tree.tree.tokens == list(reference_tree(PROMPT + [6]))
        assert error_code(gone) == grpc.StatusCode.NOT_FOUND and servicer.open_ids == {"a", "b"}
        stream.end()
        await stream.task
    run(test)


def test_the_verifier_pool_batches_a_steps_requests_where_the_replica_takes_batches(monkeypatch) -> None:
    """Sessions that draft in one round (the step loop's draft_all) share a message each way; a replica whose Info
    does not offer batches (an older one) gets one message per request. The trees are the same either way."""
    async def main(batches: bool) -> list[int]:
        drafter = RecordingDrafter()
        servicer = DrafterServicer(drafter, "r0")
        received = []
        handle = servicer._handle
        monkeypatch.setattr(servicer, "_handle", lambda requests, stream: received.append(len(requests)) or handle(
            requests, stream))
        async with connected_pool(servicer) as (pool, link):
            link.info.batches = batches
            sessions = [f"s{i}" for i in range(8)]
            for session_id in sessions:
                pool.attach(session_id, lambda: PROMPT, None)
            for step, (committed, root) in enumerate([([], 5), ([5], 6)]):
                position = len(PROMPT) + max(0, step - 1)
                trees = await pool.draft_all([DraftStep(s, step, committed, None, root, position, 8) for s in sessions])
                assert {tree.tokens for tree in trees} == {reference_tree(PROMPT + [5, 6][:step + 1])}
            return received

    assert asyncio.run(main(True)) == [16, 8]  # the first step opens every mirror too
    assert asyncio.run(main(False)) == [1] * 24


def test_a_link_sends_what_queued_together_as_one_batch(monkeypatch) -> None:
    """A request alone goes as itself; requests queued together go as one message, no larger than BATCH_BYTES (a
    seed's features can take megabytes)."""
    monkeypatch.setattr("verifier_service.drafter_pool.BATCH_BYTES", 2 * close_request("b").size)

    async def main() -> tuple:
        link = ReplicaLink("127.0.0.1:1", lambda _: None, lambda: None)  # NOTE: never connected: nothing is written
        link.info = drafter_pb2.DrafterInfoReply(batches=True)
        link.send(close_request("a"))
        alone = link._next_message()
        for session_id in ("b", "c", "d"):
            link.send(close_request(session_id))
        messages = [link._next_message(), link._next_message()]
        await link.close()
        return alone, messages, len(link.outbox)

    alone, (batch, last), left = asyncio.run(main())
    assert alone.close.session_id == "a" and left == 0
    assert [r.close.session_id for r in batch.batch.requests] == ["b", "c"] and last.close.session_id == "d"


def _random_tree(rng: random.Random) -> DraftTree:
    n = rng.randrange(0, 12)
    parents = tuple(rng.randrange(-1, i) for i in range(n))
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    logprobs = tuple(-rng.randrange(1000) / 64 for _ in range(n)) if rng.random() < 0.8 else ()  # float32 exact
    return DraftTree(tuple(rng.randrange(1000) for _ in range(n)), parents, tuple(depths), logprobs)


def test_replies_written_field_by_field_equal_the_constructed_messages() -> None:
    """A batch reply filled slot by slot (errors among the trees) is the message nested constructors build, and the
    verifier reads each tree back as drafted."""
    rng = random.Random(0)
    pending, expected = [], []
    for i in range(20):
        if i % 7 == 3:
            error = drafter_pb2.DrafterReply(error=drafter_pb2.DrafterSessionError(session_id=f"s{i}", step=i, code=5))
            pending.append(error)
            expected.append(error)
            continue
        tree = _random_tree(rng)
        pending.append(_TreeReply(f"s{i}", i, tree, "r0", 0.5))
        expected.append(drafter_pb2.DrafterReply(tree=drafter_pb2.DrafterTree(
            session_id=f"s{i}", step=i, tree=common_pb2.DraftTree(
                tokens=tree.tokens, parents=tree.parents, depths=tree.depths, logprobs=tree.logprobs),
            replica_id="r0", draft_ms=0.5)))
    stream = _Stream(None)
    stream.batches, stream.pending = True, deque(pending)
    batch = stream._next_message()
    assert batch == drafter_pb2.DrafterReply(batch=drafter_pb2.DrafterReplies(replies=expected))
    assert [_message(reply) for reply in pending] == expected
    trees = [reply.tree for reply in pending if isinstance(reply, _TreeReply)]
    assert [tree_from_reply(r.tree.tree) for r in batch.batch.replies if r.WhichOneof("kind") == "tree"] == trees


def histogram(metrics: VerifierMetrics, name: str) -> tuple[float, float]:
    """A histogram's (count, sum)."""
    samples = {s.name: s.value for family in metrics.registry.collect() for s in family.samples}
    return samples[f"{name}_count"], samples[f"{name}_sum"]


def test_a_round_counts_its_trees_per_replica_and_the_drafters_time_of_its_slowest_reply() -> None:
    pool = DrafterPool("127.0.0.1:9", VerifierMetrics())

    def tree(replica: str, draft_ms: float) -> drafter_pb2.DrafterReply:
        return drafter_pb2.DrafterReply(tree=drafter_pb2.DrafterTree(session_id="s", replica_id=replica,
                                                                    draft_ms=draft_ms))

    error = drafter_pb2.DrafterReply(error=drafter_pb2.DrafterSessionError(session_id="s", code=5))
    pool._tally([tree("r0", 0.5), tree("r1", 2.0), error, ConnectionError(), None, tree("r0", 1.0)])
    assert histogram(pool.metrics, "ddtree_verifier_drafter_compute_seconds") == (1, 0.002)
    trees = {s.labels["replica"]: s.value for family in pool.metrics.registry.collect() for s in family.samples
             if s.name == "ddtree_verifier_trees_total"}
    assert trees == {"r0": 2, "r1": 1}
    pool._tally([error, None])  # a round without a tree tells nothing of the drafters' time
    assert histogram(pool.metrics, "ddtree_verifier_drafter_compute_seconds")[0] == 1


def test_a_step_reads_back_on_the_drafter_as_the_verifier_sent_it() -> None:
    features = torch.randn(2, 3)
    for step in (DraftStep("a", 3, [4, 5], None, 6, 70, 15), DraftStep("b", 1, [], None, 2, 9, 1),
                 DraftStep("c", 2, [7, 8], features, 9, 10, 4)):
        message = drafter_pb2.DrafterStep.FromString(step_request(step).request.step.SerializeToString())
        parsed = _step_from_pb(message)
        assert replace(parsed, features=None) == replace(step, features=None)
        assert (parsed.features is None) == (step.features is None)
        if step.features is not None:
            assert torch.equal(parsed.features, step.features)


def test_requests_with_features_know_their_size_without_encoding_them() -> None:
    """A batch counts its requests' bytes: the size a request carries (measured before its features went in, then
    their bytes added) is the encoded size or a little more, never less."""
    features = torch.randn(40, 96).to(torch.bfloat16)
    requests = [step_request(DraftStep("c", 2, [7, 8], features, 9, 10, 4)),
                step_request(DraftStep("a", 3, [4], None, 6, 7, 1)),
                open_request("s", DrafterSeed(list(range(40)), features, 1000))]
    for outgoing in requests:
        assert 0 <= outgoing.size - outgoing.request.ByteSize() <= 32
    opened = drafter_pb2.DrafterRequest.FromString(requests[2].request.SerializeToString()).open
    assert list(opened.token_ids) == list(range(40)) and opened.start_position == 1000
    assert torch.equal(from_proto(opened.features), features)


def test_a_feature_window_keeps_the_latest_rows_without_joining_at_every_step() -> None:
    rows = [torch.full((n, 2), float(i)) for i, n in enumerate([3, 1, 1, 2, 1, 2, 1])]
    window, unbounded = FeatureWindow(), FeatureWindow()
    assert window.latest(4) is None
    chunks = []
    for features in rows:
        window.add(features, 4)
        unbounded.add(features, None)
        chunks.append(len(window.chunks))
    assert chunks == [1, 2, 3, 4, 1, 2, 3]  # joined (and cut to 4 rows) only on reaching 8 rows
    everything = torch.cat(rows)
    assert torch.equal(window.latest(4), everything[-4:]) and window.chunks[0].shape[0] == 4
    assert torch.equal(unbounded.latest(None), everything) and len(unbounded.chunks) == 1
    window.add(torch.ones(1, 2, dtype=torch.float64), 4)  # NOTE: rows join in the first rows' dtype
    assert window.latest(4).dtype == torch.float32 and torch.equal(window.latest(4)[-1], torch.ones(2))


@pytest.mark.parametrize(("prompt", "opens"), [(6, ["s", "fresh"]), (16, ["s", "s", "fresh"])])
def test_a_resumed_dflash_mirror_drafts_what_a_fresh_seed_does(prompt, opens, tmp_path, tiny_target) -> None:
    """The catch-up's features are the feature window's latest rows, aligned with the session's tokens: the resumed
    mirror (W = 12) drafts the tree a mirror seeded afresh from the same tokens does. A prompt longer than the
    window holds re-seeds instead, ahead of the turn's drafts."""
    model = load(tmp_path, tiny_target, {})
    feature_dim = model.config.feature_dim
    features = torch.randn(60, feature_dim, generator=torch.Generator().manual_seed(3))
    tokens = [int(t) for t in torch.randint(3, 200, (60,), generator=torch.Generator().manual_seed(4))]

    async def main() -> None:
        drafter = DFlashDrafter(model, 12, max_budget=24, max_sessions=4)
        recorded = []
        opened = drafter.open
        drafter.open = lambda session_id, seed: recorded.append(session_id) or opened(session_id, seed)
        async with connected_pool(DrafterServicer(drafter, "r0")) as (pool, _):
            shown = tokens[:20]
            pool.attach("s", lambda: shown, features[:20])
            await pool.draft(DraftStep("s", 0, [], None, tokens[20], 20, 8))
            shown += tokens[20:23]  # NOTE: the root and two more, stepped without drafts; the turn ends
            pool.add_features("s", features[20:23])
            pool.park("s")
            end = 23 + prompt
            shown += tokens[23:end]  # the next turn's prompt and its prefill's features
            pool.add_features("s", features[23:end])
            pool.open_soon("s")  # NOTE: as the turn starts: a seed that will be needed goes ahead of the drafts
            for _ in range(50):
                await asyncio.sleep(0.01)
            assert recorded == opens[:-1]
            resumed = await pool.draft(DraftStep("s", 0, [], None, tokens[end], end, 8))
            pool.attach("fresh", lambda: tokens[:end], features[:end])
            fresh = await pool.draft(DraftStep("fresh", 0, [], None, tokens[end], end, 8))
            assert_same_tree(resumed, fresh)
            assert recorded == opens

    asyncio.run(main())
