"""One Generate call seen from the gateway: verifier steps in, chunks out (a prefill's progress passed on), and
the summary's figures."""

from __future__ import annotations

from collections.abc import Callable

from gateway.metrics import GatewayMetrics
from gateway.text import OutputText
from proto import common_pb2, gateway_pb2, verifier_pb2


class Relay:
    """Turns each verifier step into a chunk (text cut at stop strings) and keeps the call's timings."""

    def __init__(self, text: OutputText, metrics: GatewayMetrics, clock: Callable[[], float], started: float):
        self.text = text
        self.metrics = metrics
        self.clock = clock
        self.started = started
        self.steps = 0
        self.generated = 0
        self.acceptance_sum = 0
        self.first_token_at: float | None = None
        self.last_step_at = started
        self.session_tokens = 0
        self.last_token: int | None = None
        self.stop_reason: int | None = None  # until a step says it finished
        self.cached_tokens = 0  # of the appended prompt, the tokens the verifier's prefix cache held

    def reply(self, step: verifier_pb2.VerifierGenerateStep) -> gateway_pb2.GenerateReply:
        """The client's message for a verifier message: a chunk for a step, the progress of a prefill as it is."""
        if step.HasField("prefill"):
            self.cached_tokens = step.prefill.cached_tokens
            return gateway_pb2.GenerateReply(prefill=step.prefill)
        return self.chunk(step)

    def chunk(self, step: verifier_pb2.VerifierGenerateStep) -> gateway_pb2.GenerateReply:
        now = self.clock()
        if step.token_ids and self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.started)
        self.metrics.observe_step(step, now - self.last_step_at if self.steps else None)
        self.steps += 1
        self.generated += len(step.token_ids)
        self.acceptance_sum += step.acceptance_length
        self.last_step_at = now
        self.session_tokens = step.num_tokens
        if step.token_ids:
            self.last_token = step.token_ids[-1]
        if step.finished:
            self.stop_reason = step.stop_reason
        chunk = gateway_pb2.GenerateChunk(text=self.text.push(step.token_ids, final=step.finished),
                                          token_ids=step.token_ids, acceptance_length=step.acceptance_length,
                                          logprobs=step.logprobs)
        return gateway_pb2.GenerateReply(chunk=chunk)

    @property
    def stop_token(self) -> int | None:
        """The token that ended the generation when a stop token did (EOS or one of stop_token_ids)."""
        return self.last_token if self.stop_reason == common_pb2.STOP_REASON_STOP_TOKEN else None

    def summary(self, handle: str, prompt_tokens: int) -> gateway_pb2.GenerateReply:
        now = self.clock()
        self.metrics.e2e.observe(now - self.started)
        first = self.first_token_at
        decode_s = now - first if first is not None else 0.0
        summary = gateway_pb2.GenerateSummary(
            stop_reason=self.stop_reason,
            session=handle,
            prompt_tokens=prompt_tokens,
            generated_tokens=self.generated,
            steps=self.steps,
            ttft_ms=1e3 * (first - self.started) if first is not None else 0.0,
            tokens_per_second=(self.generated - 1) / decode_s if decode_s > 0 else 0.0,
            mean_acceptance_length=self.acceptance_sum / self.steps if self.steps else 0.0,
            e2e_ms=1e3 * (now - self.started),
            session_tokens=self.session_tokens,
            cached_tokens=self.cached_tokens,
        )
        return gateway_pb2.GenerateReply(summary=summary)
