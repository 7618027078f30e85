from proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierCreateSessionRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt_logprobs")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class VerifierSessionInfo(_message.Message):
    __slots__ = ("session_id", "num_tokens", "prefix_length", "pages_used", "pages_shared", "generating")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    PAGES_SHARED_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    prefix_length: int
    pages_used: int
    pages_shared: int
    generating: bool
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., prefix_length: _Optional[int] = ..., pages_used: _Optional[int] = ..., pages_shared: _Optional[int] = ..., generating: _Optional[bool] = ...) -> None: ...

class VerifierCreateSessionReply(_message.Message):
    __slots__ = ("session", "prefill_ms", "prompt_logprobs", "cached_tokens")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session: VerifierSessionInfo
    prefill_ms: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    cached_tokens: int
    def __init__(self, session: _Optional[_Union[VerifierSessionInfo, _Mapping]] = ..., prefill_ms: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class VerifierGenerateRequest(_message.Message):
    __slots__ = ("session_id", "append_token_ids", "params", "keep_session", "tree_budget", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SESSION_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    keep_session: bool
    tree_budget: int
    prompt_logprobs: int
    def __init__(self, session_id: _Optional[str] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., keep_session: _Optional[bool] = ..., tree_budget: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class VerifierGenerateStep(_message.Message):
    __slots__ = ("step", "token_ids", "acceptance_length", "drafted_nodes", "finished", "stop_reason", "num_tokens", "timings", "prefill", "logprobs", "prompt_logprobs")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_NODES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    acceptance_length: int
    drafted_nodes: int
    finished: bool
    stop_reason: _common_pb2.StopReason
    num_tokens: int
    timings: _common_pb2.StepTimings
    prefill: _common_pb2.PrefillProgress
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, step: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., acceptance_length: _Optional[int] = ..., drafted_nodes: _Optional[int] = ..., finished: _Optional[bool] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, str]] = ..., num_tokens: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.StepTimings, _Mapping]] = ..., prefill: _Optional[_Union[_common_pb2.PrefillProgress, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifierStreamRequest(_message.Message):
    __slots__ = ("request_id", "generate", "cancel", "consumed", "timeout_s", "window")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    generate: VerifierGenerateRequest
    cancel: bool
    consumed: int
    timeout_s: float
    window: int
    def __init__(self, request_id: _Optional[int] = ..., generate: _Optional[_Union[VerifierGenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., consumed: _Optional[int] = ..., timeout_s: _Optional[float] = ..., window: _Optional[int] = ...) -> None: ...

class VerifierStreamReply(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[VerifierStreamEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[VerifierStreamEvent, _Mapping]]] = ...) -> None: ...

class VerifierStreamEvent(_message.Message):
    __slots__ = ("request_id", "step", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    step: VerifierGenerateStep
    error: VerifierStreamError
    def __init__(self, request_id: _Optional[int] = ..., step: _Optional[_Union[VerifierGenerateStep, _Mapping]] = ..., error: _Optional[_Union[VerifierStreamError, _Mapping]] = ...) -> None: ...

class VerifierStreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class VerifierForkSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class VerifierReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class VerifierReleaseSessionReply(_message.Message):
    __slots__ = ("pages_freed",)
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    pages_freed: int
    def __init__(self, pages_freed: _Optional[int] = ...) -> None: ...

class VerifierGetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class VerifierRenewLeasesRequest(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifierRenewLeasesReply(_message.Message):
    __slots__ = ("unknown_session_ids",)
    UNKNOWN_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfoReply(_message.Message):
    __slots__ = ("model_name", "page_size", "kv_capacity_pages", "free_pages", "max_context", "vocab_size", "eos_token_ids", "active_sessions", "max_tree_nodes", "session_lease_s", "dtype", "device", "cuda_graphs", "drafters_connected", "room_pages", "waiting_requests")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    SESSION_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    ROOM_PAGES_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    page_size: int
    kv_capacity_pages: int
    free_pages: int
    max_context: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    active_sessions: int
    max_tree_nodes: int
    session_lease_s: float
    dtype: str
    device: str
    cuda_graphs: int
    drafters_connected: int
    room_pages: int
    waiting_requests: int
    def __init__(self, model_name: _Optional[str] = ..., page_size: _Optional[int] = ..., kv_capacity_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., active_sessions: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., session_lease_s: _Optional[float] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., cuda_graphs: _Optional[int] = ..., drafters_connected: _Optional[int] = ..., room_pages: _Optional[int] = ..., waiting_requests: _Optional[int] = ...) -> None: ...
