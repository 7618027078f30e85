"""The verifier instances the gateway routes to, and what each last said about its KV pages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import NoVerifier
from gateway.generation_streams import GenerationStream
from proto import verifier_pb2, verifier_pb2_grpc
from proto.security import NO_AUTH, InternalAuth


class VerifierPool:
    """One channel per verifier address. A new session goes to the verifier with no requests waiting for KV pages
    and the most room (pages free beside what its generations under way may take) by its last Info, among those
    that answer and call themselves SERVING (ties in turn); a
    session's later calls go to the verifier recorded in its registry entry, never through `pick`.

    NOTE: create it inside the running event loop (grpc.aio channels bind to it).
    """

    def __init__(self, addresses: Sequence[str], channel_options: Sequence[tuple[str, int]] = (),
                 auth: InternalAuth = NO_AUTH):
        self.addresses = tuple(addresses)
        self._channels = {a: auth.channel(a, channel_options) for a in self.addresses}
        self._stubs = {a: verifier_pb2_grpc.VerifierStub(c) for a, c in self._channels.items()}
        self._health = {a: health_pb2_grpc.HealthStub(c) for a, c in self._channels.items()}
        self.infos: dict[str, verifier_pb2.VerifierInfoReply | None] = dict.fromkeys(self.addresses)
        self._streams: dict[str, GenerationStream] = {}
        self._turn = 0

    def stub(self, address: str) -> verifier_pb2_grpc.VerifierStub:
        return self._stubs[address]

    def generate(self, address: str, request: verifier_pb2.VerifierGenerateRequest,
                 timeout: float | None) -> AsyncIterator[verifier_pb2.VerifierGenerateStep]:
        """A generation on the verifier at `address`, over the one GenerateStream call the gateway keeps there
        (opened again after it broke); it behaves as a Generate call (gateway/generation_streams.py)."""
        stream = self._streams.get(address)
        if stream is None or stream.broken:
            stream = self._streams[address] = GenerationStream(self._stubs[address])
        return stream.generate(request, timeout)

    @property
    def up(self) -> list[str]:
        return [a for a, info in self.infos.items() if info is not None]

    async def poll(self, timeout_s: float) -> None:
        """Ask every verifier for its Info and health; one that does not answer, or is NOT_SERVING (a lost
        tensor-parallel rank), counts as down until it serves again."""
        replies = await asyncio.gather(*(self._serving_info(a, timeout_s) for a in self.addresses),
                                       return_exceptions=True)
        for address, reply in zip(self.addresses, replies):
            self.infos[address] = None if isinstance(reply, BaseException) else reply

    async def _serving_info(self, address: str, timeout_s: float) -> verifier_pb2.VerifierInfoReply | None:
        info, health = await asyncio.gather(
            self._stubs[address].Info(verifier_pb2.VerifierInfoRequest(), timeout=timeout_s),
            self._health[address].Check(health_pb2.HealthCheckRequest(), timeout=timeout_s))
        return info if health.status == health_pb2.HealthCheckResponse.SERVING else None

    def model(self) -> verifier_pb2.VerifierInfoReply:
        """The model as an answering verifier describes it (all serve the same checkpoint)."""
        up = self.up
        if not up:
            raise NoVerifier("no verifier answers now; retry later")
        return self.infos[up[0]]

    def pick(self) -> str:
        """The address for a new session; NoVerifier when none serves (the caller retries later)."""
        candidates = self.up
        if not candidates:
            raise NoVerifier("no verifier is serving now; retry later")
        most_room = max(self._room(a) for a in candidates)
        best = [a for a in candidates if self._room(a) == most_room]
        self._turn += 1
        return best[self._turn % len(best)]

    def kv_capacity_tokens(self) -> int:
        """KV tokens the serving verifiers hold in all (what quotas divide)."""
        return sum(info.kv_capacity_pages * info.page_size for info in self.infos.values() if info is not None)

    def _room(self, address: str) -> tuple[bool, int]:
        """How much room a verifier has for a new session: no queue first, then the pages it can give now."""
        info = self.infos[address]
        return (False, -1) if info is None else (info.waiting_requests == 0, info.room_pages)

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self._streams.values()))
        await asyncio.gather(*(c.close() for c in self._channels.values()))
