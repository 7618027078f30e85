"""What `ddtree serve` shows once its processes serve: one status block, a row per service from its Info call
(address, model, dtype, device, KV capacity, CUDA graphs, connections), and a one-line reason for each thing
that is not ready yet."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import astuple, dataclass

import grpc

from proto import drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

HEADINGS = ("service", "address", "model", "dtype", "device", "KV tokens", "graphs", "connected")


@dataclass(frozen=True)
class Row:
    service: str
    address: str
    model: str = "-"
    dtype: str = "-"
    device: str = "-"
    kv_tokens: str = "-"
    graphs: str = "-"
    connected: str = "-"


@dataclass(frozen=True)
class Readiness:
    rows: list[Row]
    problems: list[str]  # one line each; none when everything is ready

    def block(self) -> str:
        """The rows as an aligned table under HEADINGS."""
        table = [HEADINGS, *map(astuple, self.rows)]
        widths = [max(len(line[i]) for line in table) for i in range(len(HEADINGS))]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                         for line in table)


def drafter_row(name: str, address: str, info: drafter_pb2.DrafterInfoReply) -> Row:
    return Row(name, address, info.drafter_kind, info.dtype or "-", info.device, graphs=str(info.cuda_graphs))


def verifier_row(address: str, info: verifier_pb2.VerifierInfoReply, drafters: int) -> tuple[Row, list[str]]:
    """The row, and what is missing: drafters that did not connect (steps run without speculation meanwhile)."""
    row = Row("verifier", address, info.model_name, info.dtype, info.device,
              str(info.kv_capacity_pages * info.page_size), str(info.cuda_graphs),
              f"{info.drafters_connected}/{drafters} drafters")
    missing = [] if info.drafters_connected >= drafters else [
        f"the verifier has {info.drafters_connected} of {drafters} drafters connected (it decodes without "
        "speculation until they are)"]
    return row, missing


def gateway_row(address: str, info: gateway_pb2.InfoReply) -> tuple[Row, list[str]]:
    row = Row("gateway", address, info.model.name or "-", connected=f"{info.verifiers_up}/{info.verifiers} verifiers")
    missing = [] if info.verifiers_up >= info.verifiers else [
        f"the gateway has {info.verifiers_up} of {info.verifiers} verifiers serving"]
    return row, missing


def check(addresses: Mapping[str, str], timeout_s: float = 2.0) -> Readiness:
    """Ask each service of a local stack (`drafter-N`, `verifier`, `gateway` -> address) for its Info."""
    drafters = sum(name.startswith("drafter-") for name in addresses)
    rows, problems = [], []
    for name, address in addresses.items():
        try:
            row, missing = _service(name, address, drafters, timeout_s)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:  # NOTE: API keys are on; the gateway serves
                row, missing = Row(name, address, connected="(its Info needs an API key)"), []
            else:
                row, missing = Row(name, address), [f"{name} does not answer Info: {error.code().name}"]
        rows.append(row)
        problems += missing
    return Readiness(rows, problems)


def _service(name: str, address: str, drafters: int, timeout_s: float) -> tuple[Row, list[str]]:
    with grpc.insecure_channel(address) as channel:
        if name.startswith("drafter-"):
            info = drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.DrafterInfoRequest(), timeout=timeout_s)
            return drafter_row(name, address, info), []
        if name == "verifier":
            info = verifier_pb2_grpc.VerifierStub(channel).Info(verifier_pb2.VerifierInfoRequest(), timeout=timeout_s)
            return verifier_row(address, info, drafters)
        return gateway_row(address, gateway_pb2_grpc.GatewayStub(channel).Info(gateway_pb2.InfoRequest(),
                                                                                timeout=timeout_s))


def wait_ready(addresses: Mapping[str, str], within_s: float = 10.0) -> Readiness:
    """`check` until nothing is missing, or for `within_s`: drafters connect, and the gateway sees its verifier,
    a moment after they serve."""
    deadline = time.monotonic() + within_s
    readiness = check(addresses)
    while readiness.problems and time.monotonic() < deadline:
        time.sleep(0.25)
        readiness = check(addresses)
    return readiness
