"""`python -m proto.healthcheck ADDRESS [SERVICE]`: exit 0 when ADDRESS answers grpc.health.v1 with
SERVING (for SERVICE, default the whole server), else 1. Container healthchecks run it."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The health status name, or the gRPC status code name when the call fails."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.healthcheck", description=__doc__)
    parser.add_argument("address", help="host:port")
    parser.add_argument("service", nargs="?", default="", help="service name; default: the whole server")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    status = check(args.address, args.service, args.timeout_s)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
