"""OpenAI response bodies and stream chunks from a generation's chunks and summary: the HTTP edge's `to_pb`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from proto import common_pb2, gateway_pb2

FINISH_REASONS = {common_pb2.STOP_REASON_STOP_TOKEN: "stop", common_pb2.STOP_REASON_STOP_STRING: "stop",
                  common_pb2.STOP_REASON_LENGTH: "length", common_pb2.STOP_REASON_CONTEXT_LIMIT: "length"}


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/completions and /v1/chat/completions in their replies."""

    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        """`logprobs`: gateway/openai_logprobs.py's object, when the request asked for them."""
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(self, index: int, fields: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        """A stream choice: `fields` of the assistant message (chat) or `{"text": ...}` (completions), and the
        logprobs of the chunk's own tokens when asked for."""
        content = {"delta": fields} if self.chat else {"text": fields.get("content", "")}
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}


COMPLETIONS = Endpoint(chat=False)
CHAT = Endpoint(chat=True)


def usage(summaries: Sequence[gateway_pb2.GenerateSummary]) -> dict:
    """OpenAI's usage: the prompt once, the whole context the choices follow (the same for all); what a session
    already held (or a fork shared), prefilled before this call, and what the verifier's prefix cache held is
    `cached_tokens`. The completion counts every choice's tokens."""
    first = summaries[0]
    prompt = first.session_tokens - first.generated_tokens
    completion = sum(s.generated_tokens for s in summaries)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": prompt - first.prompt_tokens + first.cached_tokens}}


def extension(summaries: Sequence[gateway_pb2.GenerateSummary]) -> dict:
    """The "ddtree" object of a reply: the session it lives on (when kept: one choice alone can be) and the
    speculation's figures over every choice's steps."""
    steps = sum(s.steps for s in summaries)
    accepted = sum(s.mean_acceptance_length * s.steps for s in summaries)
    return {"session": summaries[0].session or None, "steps": steps,
            "mean_acceptance_length": round(accepted / steps, 4) if steps else 0.0}


def _finish_reason(summary: gateway_pb2.GenerateSummary) -> str:
    """OpenAI's name for why a choice ended ("stop" for a stop token or string, "length" at a limit)."""
    return FINISH_REASONS.get(summary.stop_reason, "stop")


class Reply:
    """One response's id, creation time, model and number of choices, shared by its body or by every chunk of its
    stream; a stream's choices end in any order, and the last one's end ends the reply."""

    def __init__(self, endpoint: Endpoint, model: str, n: int = 1, include_usage: bool = False):
        self.endpoint = endpoint
        self.n = n
        self.include_usage = include_usage
        self._head = {"id": f"{'chatcmpl' if endpoint.chat else 'cmpl'}-{uuid.uuid4().hex}",
                      "created": int(time.time()), "model": model}
        self._ended: dict[int, gateway_pb2.GenerateSummary] = {}

    def body(self, texts: Sequence[str], summaries: Sequence[gateway_pb2.GenerateSummary],
             logprobs: Sequence[dict | None], prompt_logprobs: Sequence[list] | None = None) -> dict:
        """The non-streaming response: choice i of `texts[i]`, `summaries[i]` and `logprobs[i]`, and with
        `prompt_logprobs` (vLLM's, when asked for) its `prompt_logprobs[i]`."""
        choices = [self.endpoint.choice(i, text, _finish_reason(summary), lp)
                   for i, (text, summary, lp) in enumerate(zip(texts, summaries, logprobs))]
        if prompt_logprobs is not None:
            choices = [{**choice, "prompt_logprobs": scored} for choice, scored in zip(choices, prompt_logprobs)]
        return {**self._head, "object": self.endpoint.object, "choices": choices, "usage": usage(summaries),
                "ddtree": extension(summaries)}

    def first_chunks(self) -> list[dict]:
        """A chat stream's chunks with each choice's role, ahead of any content; none for completions."""
        if not self.endpoint.chat:
            return []
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n)]

    def chunk(self, index: int, fields: dict, logprobs: dict | None = None) -> dict:
        """A stream chunk carrying `fields` of choice `index` (content) and its tokens' logprobs."""
        return self._chunk([self.endpoint.delta(index, fields, logprobs=logprobs)])

    def last_chunks(self, index: int, summary: gateway_pb2.GenerateSummary) -> list[dict]:
        """The chunk with choice `index`'s finish reason; once every choice has ended, it also carries the "ddtree"
        object, and the usage chunk follows when asked for."""
        self._ended[index] = summary
        finish = self._chunk([self.endpoint.delta(index, {}, _finish_reason(summary))])
        if len(self._ended) < self.n:
            return [finish]
        summaries = [self._ended[i] for i in range(self.n)]
        chunks = [{**finish, "ddtree": extension(summaries)}]
        if self.include_usage:
            chunks.append({**self._chunk([]), "usage": usage(summaries)})
        return chunks

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self._head, "object": self.endpoint.chunk_object, "choices": choices}
        return {**chunk, "usage": None} if self.include_usage else chunk
