"""Requests that do not parse get INVALID_ARGUMENT naming the field, not UNKNOWN with a logged traceback.

gRPC parses a request before the servicer sees it; a string field holding bytes that are not UTF-8 then fails
inside gRPC. A server interceptor swaps in a parser that keeps such a request as `Undecodable` and answers
it here. Streaming requests (the internal Draft stream) keep gRPC's own parsing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Undecodable:
    reason: str


def undecodable_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The dotted name of the first string field (nested messages included) whose bytes are not UTF-8."""
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + field.name
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = undecodable_field(field.message_type, value, name + ".")
                if found:
                    return found
        else:
            return None  # groups or garbage: nothing more to name
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return value, pos


def _parser(deserialize: Callable[[bytes], Any], descriptor: Descriptor | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError:
            field = undecodable_field(descriptor, data) if descriptor is not None else None
            if field:
                return Undecodable(f"{field}: not valid UTF-8 text")
            return Undecodable("the request is not a valid protobuf message")
    return parse


def _rejecting(behavior: Callable[..., Any], streams: bool) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await behavior(request, context)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        async for reply in behavior(request, context):
            yield reply

    return stream if streams else unary


class RejectUndecodable(grpc.aio.ServerInterceptor):
    """Add to every server: `grpc.aio.server(interceptors=[RejectUndecodable()])`."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer
        descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
        if handler.response_streaming:
            return handler._replace(request_deserializer=_parser(deserialize, descriptor),
                                    unary_stream=_rejecting(handler.unary_stream, streams=True))
        return handler._replace(request_deserializer=_parser(deserialize, descriptor),
                                unary_unary=_rejecting(handler.unary_unary, streams=False))
