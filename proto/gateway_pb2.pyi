from proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "session", "params", "keep_session", "tree_budget", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SESSION_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    session: str
    params: _common_pb2.SamplingParams
    keep_session: bool
    tree_budget: int
    prompt_logprobs: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., session: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., keep_session: _Optional[bool] = ..., tree_budget: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("messages", "session", "params", "keep_session", "tree_budget")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SESSION_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    session: str
    params: _common_pb2.SamplingParams
    keep_session: bool
    tree_budget: int
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., session: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., keep_session: _Optional[bool] = ..., tree_budget: _Optional[int] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("chunk", "summary", "prefill", "prompt")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    chunk: GenerateChunk
    summary: GenerateSummary
    prefill: _common_pb2.PrefillProgress
    prompt: PromptLogprobs
    def __init__(self, chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ..., prefill: _Optional[_Union[_common_pb2.PrefillProgress, _Mapping]] = ..., prompt: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "acceptance_length", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    acceptance_length: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., acceptance_length: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateSummary(_message.Message):
    __slots__ = ("stop_reason", "session", "prompt_tokens", "generated_tokens", "steps", "ttft_ms", "tokens_per_second", "mean_acceptance_length", "e2e_ms", "session_tokens", "cached_tokens")
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stop_reason: _common_pb2.StopReason
    session: str
    prompt_tokens: int
    generated_tokens: int
    steps: int
    ttft_ms: float
    tokens_per_second: float
    mean_acceptance_length: float
    e2e_ms: float
    session_tokens: int
    cached_tokens: int
    def __init__(self, stop_reason: _Optional[_Union[_common_pb2.StopReason, str]] = ..., session: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., mean_acceptance_length: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., session_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("text", "token_ids", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class CreateSessionReply(_message.Message):
    __slots__ = ("session", "prefill_ms", "prompt_logprobs", "cached_tokens")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    prefill_ms: float
    prompt_logprobs: PromptLogprobs
    cached_tokens: int
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ..., prefill_ms: _Optional[float] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session", "num_tokens", "pages_used", "pages_shared", "generating", "idle_s", "expires_in_s")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    PAGES_SHARED_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    session: str
    num_tokens: int
    pages_used: int
    pages_shared: int
    generating: bool
    idle_s: float
    expires_in_s: float
    def __init__(self, session: _Optional[str] = ..., num_tokens: _Optional[int] = ..., pages_used: _Optional[int] = ..., pages_shared: _Optional[int] = ..., generating: _Optional[bool] = ..., idle_s: _Optional[float] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ReleaseSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ReleaseSessionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsReply(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsReply(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "max_context", "vocab_size", "eos_token_ids", "drafter_kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_context: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafter_kind: str
    def __init__(self, name: _Optional[str] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., drafter_kind: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("version", "model", "verifiers", "verifiers_up", "auth_required", "session_idle_ttl_s", "max_sessions_per_key", "max_new_tokens_limit", "default_max_new_tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_UP_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDLE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_PER_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: str
    model: ModelInfo
    verifiers: int
    verifiers_up: int
    auth_required: bool
    session_idle_ttl_s: float
    max_sessions_per_key: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    def __init__(self, version: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., verifiers: _Optional[int] = ..., verifiers_up: _Optional[int] = ..., auth_required: _Optional[bool] = ..., session_idle_ttl_s: _Optional[float] = ..., max_sessions_per_key: _Optional[int] = ..., max_new_tokens_limit: _Optional[int] = ..., default_max_new_tokens: _Optional[int] = ...) -> None: ...
