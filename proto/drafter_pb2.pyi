from proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterRequest(_message.Message):
    __slots__ = ("open", "step", "close", "batch")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    open: DrafterOpen
    step: DrafterStep
    close: DrafterClose
    batch: DrafterRequests
    def __init__(self, open: _Optional[_Union[DrafterOpen, _Mapping]] = ..., step: _Optional[_Union[DrafterStep, _Mapping]] = ..., close: _Optional[_Union[DrafterClose, _Mapping]] = ..., batch: _Optional[_Union[DrafterRequests, _Mapping]] = ...) -> None: ...

class DrafterRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[DrafterRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[DrafterRequest, _Mapping]]] = ...) -> None: ...

class DrafterOpen(_message.Message):
    __slots__ = ("session_id", "token_ids", "features", "start_position", "acknowledge")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    start_position: int
    acknowledge: bool
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., start_position: _Optional[int] = ..., acknowledge: _Optional[bool] = ...) -> None: ...

class DrafterStep(_message.Message):
    __slots__ = ("session_id", "step", "committed_token_ids", "features", "root_token_id", "position", "tree_budget")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    root_token_id: int
    position: int
    tree_budget: int
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., root_token_id: _Optional[int] = ..., position: _Optional[int] = ..., tree_budget: _Optional[int] = ...) -> None: ...

class DrafterClose(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DrafterReply(_message.Message):
    __slots__ = ("tree", "error", "batch", "opened")
    TREE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    tree: DrafterTree
    error: DrafterSessionError
    batch: DrafterReplies
    opened: DrafterOpened
    def __init__(self, tree: _Optional[_Union[DrafterTree, _Mapping]] = ..., error: _Optional[_Union[DrafterSessionError, _Mapping]] = ..., batch: _Optional[_Union[DrafterReplies, _Mapping]] = ..., opened: _Optional[_Union[DrafterOpened, _Mapping]] = ...) -> None: ...

class DrafterOpened(_message.Message):
    __slots__ = ("session_id", "replica_id", "open_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    replica_id: str
    open_ms: float
    def __init__(self, session_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., open_ms: _Optional[float] = ...) -> None: ...

class DrafterReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[DrafterReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[DrafterReply, _Mapping]]] = ...) -> None: ...

class DrafterTree(_message.Message):
    __slots__ = ("session_id", "step", "tree", "replica_id", "draft_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    tree: _common_pb2.DraftTree
    replica_id: str
    draft_ms: float
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., replica_id: _Optional[str] = ..., draft_ms: _Optional[float] = ...) -> None: ...

class DrafterSessionError(_message.Message):
    __slots__ = ("session_id", "step", "code", "message", "replica_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    code: int
    message: str
    replica_id: str
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., replica_id: _Optional[str] = ...) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfoReply(_message.Message):
    __slots__ = ("replica_id", "drafter_kind", "block_size", "context_window", "target_layer_ids", "feature_dim", "max_tree_budget", "open_sessions", "dtype", "device", "cuda_graphs", "batches", "open_acks", "max_sessions")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    OPEN_ACKS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    drafter_kind: str
    block_size: int
    context_window: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    feature_dim: int
    max_tree_budget: int
    open_sessions: int
    dtype: str
    device: str
    cuda_graphs: int
    batches: bool
    open_acks: bool
    max_sessions: int
    def __init__(self, replica_id: _Optional[str] = ..., drafter_kind: _Optional[str] = ..., block_size: _Optional[int] = ..., context_window: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., feature_dim: _Optional[int] = ..., max_tree_budget: _Optional[int] = ..., open_sessions: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., cuda_graphs: _Optional[int] = ..., batches: _Optional[bool] = ..., open_acks: _Optional[bool] = ..., max_sessions: _Optional[int] = ...) -> None: ...
