"""Request checks at the gateway's edge: prompts and sampling parameters, each failure naming its field."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from gateway.config import GatewayConfig
from gateway.errors import InvalidArgument, PromptTooLong
from proto import common_pb2
from proto.limits import MAX_LOGIT_BIAS, MAX_LOGPROBS

# Choices of one request (OpenAI's `n`), as many generations at once: each also holds a session of the caller's quota
# while it runs (docs/limits.md), which bounds them further.
MAX_CHOICES = 16


def check_prompt_text(text: str, token_ids: Sequence[int], max_bytes: int | None) -> None:
    """The cheap checks, before any tokenization: one source, and not more bytes than a prompt that fits can
    have (a tokenizer takes seconds over megabytes)."""
    if text and token_ids:
        raise InvalidArgument("text, token_ids: give one of them, not both")
    size = len(text.encode())
    if max_bytes is not None and size > max_bytes:
        raise PromptTooLong(f"text: {size} bytes cannot fit the model's context (at most {max_bytes})")


def check_messages(messages: Sequence[Mapping[str, str]], max_bytes: int | None) -> None:
    """A chat's cheap checks before its template runs: some messages, each with a role, and not more bytes of
    content than a prompt that fits can have."""
    if not messages:
        raise InvalidArgument("messages: at least one message is needed")
    for i, message in enumerate(messages):
        if not message["role"]:
            raise InvalidArgument(f"messages[{i}].role: empty")
    size = sum(len(m["content"].encode()) for m in messages)
    if max_bytes is not None and size > max_bytes:
        raise PromptTooLong(f"messages: {size} bytes of content cannot fit the model's context (at most {max_bytes})")


def prompt_ids(ids: Sequence[int], *, required: bool, vocab_size: int | None,
               max_context: int | None) -> list[int]:
    """The prompt's token ids (tokenized text, or the request's token_ids) checked against the model."""
    ids = list(ids)
    if required and not ids:
        raise InvalidArgument("text/token_ids: the prompt is empty")
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        raise InvalidArgument(f"token_ids: {bad} is not a token id of the model (vocabulary {vocab_size})")
    if max_context is not None and len(ids) >= max_context:
        raise PromptTooLong(f"text/token_ids: {len(ids)} tokens do not fit the model's context of {max_context}")
    return ids


def checked_params(params: common_pb2.SamplingParams, config: GatewayConfig,
                   vocab_size: int | None) -> common_pb2.SamplingParams:
    """A copy of `params` that the verifier can run, with max_new_tokens defaulted."""
    _check_range("params.temperature", params.temperature, 0.0, config.max_temperature)
    _check_range("params.top_p", params.top_p, 0.0, 1.0)
    _check_range("params.top_k", params.top_k, 0, vocab_size if vocab_size is not None else 2**31 - 1)
    _check_range("params.max_new_tokens", params.max_new_tokens, 0, config.max_new_tokens_limit)
    if params.HasField("logprobs"):
        _check_range("params.logprobs", params.logprobs, 0, MAX_LOGPROBS)
    for token in params.stop_token_ids:
        _check_range("params.stop_token_ids", token, 0, (vocab_size or 2**31) - 1)
    if len(params.stop_strings) > config.max_stop_strings:
        raise InvalidArgument(f"params.stop_strings: at most {config.max_stop_strings} are allowed")
    if any(not 0 < len(s) <= config.max_stop_string_chars for s in params.stop_strings):
        raise InvalidArgument(f"params.stop_strings: each must have 1 to {config.max_stop_string_chars} characters")
    _check_logit_adjustments(params, vocab_size)
    checked = common_pb2.SamplingParams()
    checked.CopyFrom(params)
    checked.max_new_tokens = params.max_new_tokens or config.default_max_new_tokens
    return checked


def _check_logit_adjustments(params: common_pb2.SamplingParams, vocab_size: int | None) -> None:
    """The penalties and logit_bias; an unset repetition_penalty is 1 (off), a set one must be positive."""
    if params.HasField("repetition_penalty") and not 0 < params.repetition_penalty < math.inf:
        raise InvalidArgument(f"params.repetition_penalty: must be > 0, got {params.repetition_penalty}")
    _check_range("params.presence_penalty", params.presence_penalty, -2.0, 2.0)
    _check_range("params.frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"params.logit_bias: {len(params.logit_bias)} tokens, at most {MAX_LOGIT_BIAS}")
    last = (vocab_size or 2**31) - 1
    for token, bias in sorted(params.logit_bias.items()):
        if not 0 <= token <= last:
            raise InvalidArgument(f"params.logit_bias: token {token} is outside the vocabulary (0..{last})")
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise InvalidArgument(f"params.logit_bias: token {token}'s bias {bias} is outside [-100, 100]")


def check_choices(n: int, keep_session: bool) -> None:
    """1 to MAX_CHOICES; more than one only when no session is kept, since a session continues one generation
    and nothing says which of the n it would be."""
    _check_range("n", n, 1, MAX_CHOICES)
    if n > 1 and keep_session:
        raise InvalidArgument(f"n: {n} choices with keep_session: a kept session continues one generation, and "
                              "nothing says which; ask for n = 1 to keep a session")


def check_prompt_logprobs(prompt_logprobs: int | None) -> None:
    """None (none asked for) or 0 to MAX_LOGPROBS alternatives."""
    if prompt_logprobs is not None:
        _check_range("prompt_logprobs", prompt_logprobs, 0, MAX_LOGPROBS)


def check_tree_budget(tree_budget: int) -> None:
    """Only the sign: the maximum is the verifier's (its --tree-budget), which checks it."""
    if tree_budget < 0:
        raise InvalidArgument(f"tree_budget: {tree_budget} is negative (0 = the verifier's policy)")


def _check_range(field: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidArgument(f"{field}: {value} is outside [{low}, {high}]")
