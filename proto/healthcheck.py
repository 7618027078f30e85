"""`python -m proto.healthcheck ADDRESS [SERVICE]`: exit 0 when ADDRESS answers grpc.health.v1 with
SERVING (for SERVICE, default the whole server), else 1. Container healthchecks run it: on a verifier or a
drafter with `--internal` (the deployment's credentials, from the same DDTREE_INTERNAL_* variables the service
reads), on the gateway with the --tls-* options of a client."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.security import add_client_tls_args, add_internal_auth_args, client_channel, client_tls, internal_auth


def check(address: str, service: str = "", timeout_s: float = 3.0,
          dial: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel) -> str:
    """The health status name, or the gRPC status code name when the call fails. `dial` makes the channel
    (InternalAuth.channel, or security.client_channel with TLS files)."""
    async def status() -> str:
        async with dial(address) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            except grpc.RpcError as error:
                return error.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return asyncio.run(status())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.healthcheck", description=__doc__)
    parser.add_argument("address", help="host:port")
    parser.add_argument("service", nargs="?", default="", help="service name; default: the whole server")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--internal", action="store_true",
                        help="dial as a service of the deployment, with the --internal-* credentials")
    add_client_tls_args(parser)
    add_internal_auth_args(parser)
    args = parser.parse_args(argv)
    dial = internal_auth(args).channel if args.internal else functools.partial(client_channel, tls=client_tls(args))
    status = check(args.address, args.service, args.timeout_s, dial)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
