"""The committed generated gRPC code: current with proto/*.proto, importable, and working on the wire."""

from __future__ import annotations

import asyncio
import importlib
import re
import struct
from pathlib import Path

import grpc
import pytest

from proto import common_pb2, drafter_pb2, drafter_pb2_grpc
from proto.generate import PROTO_DIR, REPO_ROOT, generate, generated_names, proto_files

# NOTE: the oldest protobuf runtime the generated code must import under (the GPU machine's 7.36);
# a *_pb2.py refuses a runtime older than the protoc that generated it.
OLDEST_PROTOBUF = (7, 36, 0)
SERVICES = {"gateway": "Gateway", "verifier": "Verifier", "drafter": "Drafter"}


def test_generated_code_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="regenerating needs grpcio-tools")
    generate(tmp_path)
    stale = [name for name in generated_names()
             if (tmp_path / name).read_bytes() != (REPO_ROOT / name).read_bytes()]
    assert not stale, f"stale generated code, run `python -m proto.generate`: {stale}"
    committed = {f"proto/{p.name}" for p in PROTO_DIR.glob("*_pb2*.py*")}
    orphans = committed - set(generated_names())
    assert not orphans, f"generated files without a .proto: {sorted(orphans)}"


@pytest.mark.parametrize("proto", [p.stem for p in proto_files()])
def test_generated_modules_import(proto: str) -> None:
    messages = importlib.import_module(f"proto.{proto}_pb2")
    stubs = importlib.import_module(f"proto.{proto}_pb2_grpc")
    assert messages.DESCRIPTOR.package == "ddtree.v1"
    if proto in SERVICES:
        service = SERVICES[proto]
        assert messages.DESCRIPTOR.services_by_name[service]
        assert callable(getattr(stubs, f"{service}Stub"))
        assert callable(getattr(stubs, f"add_{service}Servicer_to_server"))


@pytest.mark.parametrize("proto", [p.stem for p in proto_files()])
def test_gencode_accepts_oldest_protobuf_runtime(proto: str) -> None:
    header = (PROTO_DIR / f"{proto}_pb2.py").read_text()
    version = re.search(r"^# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)$", header, re.MULTILINE)
    gencode = tuple(int(v) for v in version.groups())
    assert gencode[0] == OLDEST_PROTOBUF[0] and gencode <= OLDEST_PROTOBUF, gencode


class _EchoDrafter(drafter_pb2_grpc.DrafterServicer):
    """Answers each step with a one-node tree (root + 1) and a feature checksum in its logprob."""

    async def Draft(self, requests, context):
        async for request in requests:
            if request.WhichOneof("kind") != "step":
                continue
            step = request.step
            checksum = sum(struct.unpack(f"<{len(step.features.data) // 4}f", step.features.data))
            tree = common_pb2.DraftTree(tokens=[step.root_token_id + 1], parents=[-1], depths=[1],
                                        logprobs=[checksum])
            yield drafter_pb2.DrafterReply(tree=drafter_pb2.DrafterTree(
                session_id=step.session_id, step=step.step, tree=tree, replica_id="r0"))


async def _draft_round_trip() -> list[drafter_pb2.DrafterReply]:
    server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(_EchoDrafter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    features = common_pb2.Tensor(dtype="float32", shape=[2, 2], data=struct.pack("<4f", 1, 2, 3, 4.5))
    requests = [
        drafter_pb2.DrafterRequest(open=drafter_pb2.DrafterOpen(session_id="s", token_ids=[5, 6])),
        drafter_pb2.DrafterRequest(step=drafter_pb2.DrafterStep(
            session_id="s", step=7, committed_token_ids=[6, 9], features=features, root_token_id=41,
            position=1, tree_budget=4)),
        drafter_pb2.DrafterRequest(close=drafter_pb2.DrafterClose(session_id="s")),
    ]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            return [reply async for reply in stub.Draft(iter(requests))]
    finally:
        await server.stop(None)


def test_drafter_stream_round_trip() -> None:
    """The generated stubs work with this grpcio over a real loopback bidirectional stream."""
    (reply,) = asyncio.run(_draft_round_trip())
    assert reply.tree.session_id == "s" and reply.tree.step == 7 and reply.tree.replica_id == "r0"
    assert list(reply.tree.tree.tokens) == [42] and list(reply.tree.tree.depths) == [1]
    assert reply.tree.tree.logprobs[0] == pytest.approx(10.5)
