"""OpenAI request bodies (JSON) in the gateway's terms: the HTTP edge's `from_pb`.

Only the JSON's shape is checked here (types, fields this server does not implement); ranges and limits are
gateway/validation.py's, as for gRPC. Every failure is InvalidArgument whose message starts with the OpenAI
field it is about, which the error reply names as `param`. `names` maps the domain's field names (those
validation.py's messages start with) to this request's, for the same purpose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidArgument
from proto import common_pb2

# Fields this server does not implement: a request may send them only with a value that asks for nothing.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "prompt_logprobs": (None,), "suffix": (None, ""),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}
_UINT64 = 2**64
_INT32 = 2**31
# The logit adjustments (OpenAI's penalties and logit_bias, vLLM's repetition_penalty), all at the body's top level.
_ADJUSTMENTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")


@dataclass(frozen=True)
class OpenAIRequest:
    """One completion or chat completion request: the prompt (text, token ids or messages), its sampling
    parameters, how many choices, how to answer, and the "ddtree" extension (a session to continue, keep or
    fork)."""

    model: str
    params: common_pb2.SamplingParams
    n: int
    stream: bool
    include_usage: bool
    names: Mapping[str, str]
    text: str = ""
    token_ids: tuple[int, ...] = ()
    messages: tuple[dict[str, str], ...] = ()
    session: str = ""
    keep_session: bool = False
    fork: bool = False
    echo: bool = False  # completions: the prompt before each choice's text (and its logprobs before theirs)
    prompt_logprobs: int | None = None  # completions: vLLM's field, each prompt token's logprob and alternatives
    prompt_only: bool = False  # `echo` with max_tokens 0: the prompt (and its logprobs) alone, nothing generated

    @property
    def echo_logprobs(self) -> int | None:
        """The alternatives of the echoed prompt's `logprobs` (the request's `logprobs`); None: none."""
        return self.params.logprobs if self.echo and self.params.HasField("logprobs") else None

    @property
    def prompt_width(self) -> int | None:
        """The alternatives to compute for the prompt's tokens, for `echo` and `prompt_logprobs` both; None: none."""
        asked = [n for n in (self.echo_logprobs, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else None


def completion_request(body: Any) -> OpenAIRequest:
    """POST /v1/completions: `prompt` is a string or token ids (or a list holding one of them); `echo`, and vLLM's
    `prompt_logprobs` (not with `stream`, as vLLM)."""
    body = _object(body, "request body")
    text, token_ids = _prompt(body.get("prompt"))
    if body.get("top_logprobs") not in (None, 0):
        raise InvalidArgument("top_logprobs: a chat field; completions ask for N alternatives with logprobs: N")
    logprobs = ("logprobs", _integer(body, "logprobs", None))
    echo = _typed(body, "echo", bool, False)
    prompt_logprobs = _int32(body, "prompt_logprobs")
    if prompt_logprobs is not None and _typed(body, "stream", bool, False):
        raise InvalidArgument("prompt_logprobs: not with stream: true (as vLLM); use echo with logprobs to stream "
                              "the prompt's logprobs")
    request = _request(body, "prompt", "max_tokens", logprobs, ("echo", "prompt_logprobs"), echo=echo,
                       prompt_logprobs=prompt_logprobs, text=text, token_ids=token_ids)
    if request.prompt_only and request.session:
        raise InvalidArgument("max_tokens: 0 (the prompt alone) prefills a new prompt; with ddtree.session there is "
                              "no call that appends without generating")
    return request


def chat_request(body: Any) -> OpenAIRequest:
    """POST /v1/chat/completions: `messages` with text content (a string, or text parts)."""
    body = _object(body, "request body")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidArgument("messages: must be a list of messages")
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _request(body, "messages", max_field, ("top_logprobs", _chat_logprobs(body)),
                    messages=tuple(_message(m, i) for i, m in enumerate(messages)))


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs` alternatives (0 when absent); None: no logprobs. `top_logprobs`
    without `logprobs: true` is refused, as by OpenAI."""
    top = _integer(body, "top_logprobs", None)
    if not _typed(body, "logprobs", bool, False):
        if top is not None:
            raise InvalidArgument("top_logprobs: needs logprobs: true")
        return None
    return 0 if top is None else top


def _request(body: dict, prompt_field: str, max_field: str, logprobs: tuple[str, int | None],
             implemented: tuple[str, ...] = (), **prompt: Any) -> OpenAIRequest:
    """`logprobs`: the request's field that names the number of alternatives, and the number (None: none).
    `implemented`: fields of _NO_OP_VALUES this endpoint does implement."""
    for name, no_ops in _NO_OP_VALUES.items():
        if name not in implemented and body.get(name) not in no_ops:
            allowed = " or ".join(json.dumps(v) for v in no_ops)
            raise InvalidArgument(f"{name}: {json.dumps(body[name])} is not supported (only {allowed})")
    stream = _typed(body, "stream", bool, False)
    options = _object(body.get("stream_options") or {}, "stream_options")
    if options and not stream:
        raise InvalidArgument("stream_options: only with stream: true")
    extension = _object(body.get("ddtree") or {}, "ddtree")
    session = _typed(extension, "session", str, "", "ddtree.")
    fork = _typed(extension, "fork", bool, False, "ddtree.")
    if fork and not session:
        raise InvalidArgument("ddtree.fork: needs ddtree.session, the session to fork")
    names = {"text": prompt_field, "token_ids": prompt_field, "text/token_ids": prompt_field,
             "params.temperature": "temperature", "params.top_p": "top_p", "params.max_new_tokens": max_field,
             "params.stop_strings": "stop", "session": "ddtree.session", "params.logprobs": logprobs[0],
             "prompt_logprobs": "prompt_logprobs",
             **{f"params.{name}": name for name in _ADJUSTMENTS}}
    echo = prompt.get("echo", False)
    prompt_only = echo and _integer(body, max_field, None) == 0
    return OpenAIRequest(model=_typed(body, "model", str, ""), params=_params(body, max_field, logprobs, echo),
                         prompt_only=prompt_only,
                         n=_integer(body, "n", 1), stream=stream, names=names,
                         include_usage=_typed(options, "include_usage", bool, False, "stream_options."),
                         session=session, keep_session=_typed(extension, "keep_session", bool, False, "ddtree."),
                         fork=fork, **prompt)


def _params(body: dict, max_field: str, logprobs: tuple[str, int | None], echo: bool) -> common_pb2.SamplingParams:
    """OpenAI's defaults where the field is absent: temperature 1 and top_p 1 (sampling); max tokens: the
    server's default (0 only with `echo`: none, the prompt alone); no logprobs."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise InvalidArgument("stop: must be a string or a list of strings")
    max_tokens = _integer(body, max_field, 0)
    if body.get(max_field) is not None and not (0 if echo else 1) <= max_tokens < _INT32:
        raise InvalidArgument(f"{max_field}: must be a positive 32-bit integer (or 0 with echo: true, the prompt "
                              f"alone), got {max_tokens}")
    params = common_pb2.SamplingParams(temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                                       max_new_tokens=max_tokens, stop_strings=stops)
    seed = _integer(body, "seed", None)
    if seed is not None:
        if not 0 <= seed < _UINT64:
            raise InvalidArgument(f"seed: must be in [0, 2**64), got {seed}")
        params.seed = seed
    field, alternatives = logprobs
    if alternatives is not None:
        _check_int32(field, alternatives)
        params.logprobs = alternatives
    _logit_adjustments(body, params)
    return params


def _int32(body: dict, name: str) -> int | None:
    value = _integer(body, name, None)
    if value is not None:
        _check_int32(name, value)
    return value


def _check_int32(name: str, value: int) -> None:
    """Fits the contract's int32; the range itself is validation.py's, as for gRPC."""
    if not -_INT32 <= value < _INT32:
        raise InvalidArgument(f"{name}: must be a 32-bit integer, got {value}")


def _logit_adjustments(body: dict, params: common_pb2.SamplingParams) -> None:
    """The penalties (0 when absent; repetition_penalty: unset, i.e. 1) and logit_bias, whose keys are token ids
    written as strings (JSON's keys are strings). Ranges are validation.py's."""
    params.presence_penalty = _number(body, "presence_penalty", 0.0)
    params.frequency_penalty = _number(body, "frequency_penalty", 0.0)
    if body.get("repetition_penalty") is not None:
        params.repetition_penalty = _number(body, "repetition_penalty", 1.0)
    for key, bias in _object(body.get("logit_bias") or {}, "logit_bias").items():
        if not re.fullmatch(r"-?[0-9]{1,10}", key) or not -_INT32 <= int(key) < _INT32:
            raise InvalidArgument(f"logit_bias: keys are token ids, got {json.dumps(key)}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidArgument(f"logit_bias: the bias of token {key} must be a number")
        params.logit_bias[int(key)] = bias


def _prompt(prompt: Any) -> tuple[str, tuple[int, ...]]:
    """A string, token ids, or a list holding one of them: one prompt per request (OpenAI's batches: no)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, ()
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "", tuple(prompt)
    raise InvalidArgument("prompt: must be a string or a list of token ids (one prompt per request)")


def _message(message: Any, i: int) -> dict[str, str]:
    message = _object(message, f"messages[{i}]")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidArgument(f"messages[{i}].role: must be a string")
    return {"role": role, "content": _content(message.get("content"), f"messages[{i}].content")}


def _content(content: Any, name: str) -> str:
    """A message's text: a string (null as empty), or text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidArgument(f"{name}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidArgument(f"{name}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name}: must be a JSON object")
    return value


def _typed(body: dict, name: str, kind: type, default: Any, prefix: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidArgument(f"{prefix}{name}: must be a {kind.__name__}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name}: must be a number")
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}: must be an integer")
    return value
