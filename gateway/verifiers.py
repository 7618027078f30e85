"""The verifier instances the gateway routes to, and what each last said about its KV pages."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from gateway.errors import NoVerifier
from proto import verifier_pb2, verifier_pb2_grpc


class VerifierPool:
    """One channel per verifier address. A new session goes to the verifier with the most free KV
    pages by its last Info (ties, and verifiers not heard from yet, in turn); a session's later
    calls go to the verifier recorded in its registry entry, never through `pick`.

    NOTE: create it inside the running event loop (grpc.aio channels bind to it).
    """

    def __init__(self, addresses: Sequence[str], channel_options: Sequence[tuple[str, int]] = ()):
        self.addresses = tuple(addresses)
        self._channels = {a: grpc.aio.insecure_channel(a, options=list(channel_options)) for a in self.addresses}
        self._stubs = {a: verifier_pb2_grpc.VerifierStub(c) for a, c in self._channels.items()}
        self.infos: dict[str, verifier_pb2.VerifierInfoReply | None] = dict.fromkeys(self.addresses)
        self._turn = 0

    def stub(self, address: str) -> verifier_pb2_grpc.VerifierStub:
        return self._stubs[address]

    @property
    def up(self) -> list[str]:
        return [a for a, info in self.infos.items() if info is not None]

    async def poll(self, timeout_s: float) -> None:
        """Ask every verifier for its Info; one that does not answer counts as down until it does."""
        replies = await asyncio.gather(
            *(self._stubs[a].Info(verifier_pb2.VerifierInfoRequest(), timeout=timeout_s) for a in self.addresses),
            return_exceptions=True)
        for address, reply in zip(self.addresses, replies):
            self.infos[address] = None if isinstance(reply, BaseException) else reply

    def model(self) -> verifier_pb2.VerifierInfoReply:
        """The model as an answering verifier describes it (all serve the same checkpoint)."""
        up = self.up
        if not up:
            raise NoVerifier("no verifier answers now; retry later")
        return self.infos[up[0]]

    def pick(self) -> str:
        """The address for a new session."""
        candidates = self.up or list(self.addresses)
        most_free = max(self._free_pages(a) for a in candidates)
        best = [a for a in candidates if self._free_pages(a) == most_free]
        self._turn += 1
        return best[self._turn % len(best)]

    def _free_pages(self, address: str) -> int:
        info = self.infos[address]
        return -1 if info is None else info.free_pages

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()))
