"""Errors over HTTP: the status a gRPC call would end with, as an HTTP status and OpenAI's error object.

The exceptions are the gRPC layer's (gateway/errors.py, proto/status.py; a verifier's through
`verifier_status`), so both APIs fail the same request the same way; this module only translates.
"""

from __future__ import annotations

import logging

import grpc

from gateway.errors import PromptTooLong, verifier_status
from proto.status import StatusError, status_of

log = logging.getLogger(__name__)

Code = grpc.StatusCode
# (HTTP status, OpenAI error type) of each gRPC status, and of the error classes that refine one.
HTTP_STATUS: dict[Code | type[Exception], tuple[int, str]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    PromptTooLong: (413, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.PERMISSION_DENIED: (403, "permission_error"),
    Code.NOT_FOUND: (404, "not_found_error"),
    Code.FAILED_PRECONDITION: (409, "conflict_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.CANCELLED: (499, "cancelled_error"),
    Code.INTERNAL: (500, "server_error"),
    Code.UNIMPLEMENTED: (501, "server_error"),
    Code.UNAVAILABLE: (503, "service_unavailable_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# The statuses whose details start with the field at fault ("temperature: ..."): OpenAI's `param`.
NAMES_FIELD = {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.PERMISSION_DENIED}


def http_error(error: Exception) -> tuple[Code, int, dict]:
    """The gRPC status `error` ends a call with, and its HTTP status and body. An unexpected error is logged
    and gets a fixed message (its text may name paths or addresses), as over gRPC."""
    status = verifier_status(error) or (status_of(error) if isinstance(error, StatusError) else None)
    if status is None:
        log.exception("unexpected failure of an HTTP request")
        status = Code.INTERNAL, f"internal error: {type(error).__name__}"
    code, message = status
    http, kind = HTTP_STATUS.get(type(error)) or HTTP_STATUS.get(code, (500, "server_error"))
    field, sep, _ = message.partition(": ")
    param = field if sep and code in NAMES_FIELD and " " not in field else None
    return code, http, error_body(message, kind, code.name.lower(), param)


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
