"""OpenAI response bodies and stream chunks from a generation's chunks and summary: the HTTP edge's `to_pb`."""

from __future__ import annotations

import time
import uuid
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

    def choice(self, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        """`logprobs`: gateway/openai_logprobs.py's object, when the request asked for them."""
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(self, fields: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        """A stream choice: `fields` of the assistant message (chat) or `{"text": ...}` (completions), and the
        logprobs of the chunk's own tokens when asked for."""
        content = {"delta": fields} if self.chat else {"text": fields.get("content", "")}
        return {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason}


COMPLETIONS = Endpoint(chat=False)
CHAT = Endpoint(chat=True)


def usage(summary: gateway_pb2.GenerateSummary) -> dict:
    """OpenAI's usage: the prompt is the whole context the reply follows; what a session already held (or a
    fork shared) is `cached_tokens`, prefilled before this call."""
    prompt = summary.session_tokens - summary.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": summary.generated_tokens,
            "total_tokens": summary.session_tokens,
            "prompt_tokens_details": {"cached_tokens": prompt - summary.prompt_tokens}}


def extension(summary: gateway_pb2.GenerateSummary) -> dict:
    """The "ddtree" object of a reply: the session it lives on (when kept) and the speculation's figures."""
    return {"session": summary.session or None, "steps": summary.steps,
            "mean_acceptance_length": round(summary.mean_acceptance_length, 4)}


class Reply:
    """One response's id, creation time and model, shared by its body or by every chunk of its stream."""

    def __init__(self, endpoint: Endpoint, model: str, include_usage: bool = False):
        self.endpoint = endpoint
        self.include_usage = include_usage
        self._head = {"id": f"{'chatcmpl' if endpoint.chat else 'cmpl'}-{uuid.uuid4().hex}",
                      "created": int(time.time()), "model": model}

    def body(self, text: str, summary: gateway_pb2.GenerateSummary, logprobs: dict | None = None) -> dict:
        """The non-streaming response."""
        choice = self.endpoint.choice(text, FINISH_REASONS.get(summary.stop_reason, "stop"), logprobs)
        return {**self._head, "object": self.endpoint.object, "choices": [choice], "usage": usage(summary),
                "ddtree": extension(summary)}

    def chunk(self, fields: dict, logprobs: dict | None = None) -> dict:
        """A stream chunk carrying `fields` of the reply (the role first, then content) and its tokens' logprobs."""
        return self._chunk([self.endpoint.delta(fields, logprobs=logprobs)])

    def last_chunks(self, summary: gateway_pb2.GenerateSummary) -> list[dict]:
        """The chunk with the finish reason and the "ddtree" object, then the usage chunk when asked for."""
        finish = self.endpoint.delta({}, FINISH_REASONS.get(summary.stop_reason, "stop"))
        chunks = [{**self._chunk([finish]), "ddtree": extension(summary)}]
        if self.include_usage:
            chunks.append({**self._chunk([]), "usage": usage(summary)})
        return chunks

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self._head, "object": self.endpoint.chunk_object, "choices": choices}
        return {**chunk, "usage": None} if self.include_usage else chunk
