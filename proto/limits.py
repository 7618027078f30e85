"""Limits the contracts state (proto/*.proto) and both services check: the gateway at its edge, the verifier's engine
again for its own callers."""

from __future__ import annotations

# NOTE: alternatives per token (SamplingParams.logprobs, prompt_logprobs), as vLLM's default max_logprobs and OpenAI's
# top_logprobs
MAX_LOGPROBS = 20
# NOTE: tokens one logit_bias may name (SamplingParams.logit_bias)
MAX_LOGIT_BIAS = 300
