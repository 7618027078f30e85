"""The gateway's settings, fixed at start (the API keys live apart: a config may be logged, keys never)."""

from __future__ import annotations

from dataclasses import dataclass

from proto.security import NO_AUTH, InternalAuth, Tls


@dataclass(frozen=True)
class GatewayConfig:
    verifiers: tuple[str, ...]  # addresses; a new session goes to the one with the most KV room (gateway/verifiers.py)
    tokenizer_dir: str  # the target checkpoint's directory (its tokenizer.json)
    listen: str = "[::]:50051"
    # The OpenAI-compatible HTTP API (host:port), on the same event loop as gRPC; "" = off. Off unless asked:
    # an HTTP port is one more thing a deployment must decide to publish.
    http_listen: str = ""
    # Both public ports (gRPC and HTTP) serve TLS with these files (a `ca` requires client certificates it
    # signed); None: plaintext, which a non-loopback address takes only with allow_plaintext (docs/security.md).
    tls: Tls | None = None
    allow_plaintext: bool = False
    internal: InternalAuth = NO_AUTH  # what the gateway shows the verifiers
    metrics_port: int = 0  # Prometheus over HTTP; 0 = off
    metrics_addr: str = "127.0.0.1"  # loopback unless told otherwise
    session_idle_ttl_s: float = 600.0
    max_sessions_per_key: int = 64  # NOTE: a one-shot generation holds a session while it runs
    # Quotas count per API key ("key"; with auth off all callers share one account) or per client address
    # ("peer"). An account may hold this share of the serving verifiers' KV tokens (a running generation
    # counts its appended text and max_new_tokens); the one shared account of "key" without auth holds all.
    quota_by: str = "key"
    kv_share_per_key: float = 0.5
    max_new_tokens_limit: int = 8192
    default_max_new_tokens: int = 256
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_temperature: float = 100.0
    max_message_bytes: int = 8 << 20  # larger requests are RESOURCE_EXHAUSTED (grpc enforces it)
    # Clients reconnect after this age, so new gateway replicas behind a balancer get traffic; the
    # grace lets running generations finish.
    max_connection_age_s: float = 1800.0
    max_connection_age_grace_s: float = 600.0
    housekeeping_interval_s: float = 1.0  # verifier Info polling, lease renewal and idle-session expiry
    verifier_info_timeout_s: float = 2.0
    # Deadlines of internal calls when the client set none (or a longer one): session calls, and the prefill
    # of CreateSession. A Generate stream has the client's deadline only; keepalive pings notice a verifier
    # that froze or vanished under it.
    verifier_call_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0
    verifier_keepalive_s: float = 10.0
    verifier_keepalive_timeout_s: float = 5.0
    # Prompts longer than this many UTF-8 bytes are refused before they are tokenized; 0 = the most bytes a
    # prompt that fits the model's context can have (its context x the longest token's bytes x 2).
    max_prompt_bytes: int = 0
    tokenizer_threads: int = 2  # tokenization runs here, off the event loop
    # A gateway with no serving verifier for this long exits (status 3) for its restart policy; 0 = stays up.
    exit_without_verifier_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.verifiers:
            raise ValueError("at least one verifier address is needed")
        if self.allow_plaintext and self.tls is not None:
            raise ValueError("plaintext was asked for beside TLS: choose one")
        if not 0 < self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens must be in (0, max_new_tokens_limit]")
        if self.quota_by not in ("key", "peer"):
            raise ValueError("quota_by must be 'key' or 'peer'")
        if not 0 < self.kv_share_per_key <= 1:
            raise ValueError("kv_share_per_key must be in (0, 1]")
