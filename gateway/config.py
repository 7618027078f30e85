"""The gateway's settings, fixed at start (the API keys live apart: a config may be logged, keys never)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    verifiers: tuple[str, ...]  # addresses; a new session goes to the one with the most free KV pages
    tokenizer_dir: str  # the target checkpoint's directory (its tokenizer.json)
    listen: str = "[::]:50051"
    metrics_port: int = 0  # Prometheus over HTTP; 0 = off
    metrics_addr: str = "0.0.0.0"
    session_idle_ttl_s: float = 600.0
    max_sessions_per_key: int = 64  # NOTE: a one-shot generation holds a session while it runs
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
    housekeeping_interval_s: float = 1.0  # verifier Info polling and idle-session expiry
    verifier_info_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.verifiers:
            raise ValueError("at least one verifier address is needed")
        if not 0 < self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens must be in (0, max_new_tokens_limit]")
