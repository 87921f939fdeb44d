from proto.recmem.v1 import event_pb2 as _event_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplayOptions(_message.Message):
    __slots__ = ("enabled", "notes")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    notes: int
    def __init__(self, enabled: _Optional[bool] = ..., notes: _Optional[int] = ...) -> None: ...

class RankRequest(_message.Message):
    __slots__ = ("user_id", "candidate_item_ids", "k", "replay", "context", "request_ts_ms")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TS_MS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    candidate_item_ids: _containers.RepeatedScalarFieldContainer[str]
    k: int
    replay: ReplayOptions
    context: _containers.RepeatedCompositeFieldContainer[_event_pb2.Event]
    request_ts_ms: int
    def __init__(self, user_id: _Optional[str] = ..., candidate_item_ids: _Optional[_Iterable[str]] = ..., k: _Optional[int] = ..., replay: _Optional[_Union[ReplayOptions, _Mapping]] = ..., context: _Optional[_Iterable[_Union[_event_pb2.Event, _Mapping]]] = ..., request_ts_ms: _Optional[int] = ...) -> None: ...

class ScoredItem(_message.Message):
    __slots__ = ("item_id", "score")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    score: float
    def __init__(self, item_id: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class RankResponse(_message.Message):
    __slots__ = ("items", "model_version", "position", "cold_start", "notes_replayed", "context_applied")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COLD_START_FIELD_NUMBER: _ClassVar[int]
    NOTES_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_APPLIED_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoredItem]
    model_version: str
    position: int
    cold_start: bool
    notes_replayed: int
    context_applied: int
    def __init__(self, items: _Optional[_Iterable[_Union[ScoredItem, _Mapping]]] = ..., model_version: _Optional[str] = ..., position: _Optional[int] = ..., cold_start: _Optional[bool] = ..., notes_replayed: _Optional[int] = ..., context_applied: _Optional[int] = ...) -> None: ...

class RankBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RankRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[RankRequest, _Mapping]]] = ...) -> None: ...

class RankBatchResult(_message.Message):
    __slots__ = ("code", "message", "response", "owner", "retry_pushback_ms", "partition", "generation")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RETRY_PUSHBACK_MS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    response: RankResponse
    owner: str
    retry_pushback_ms: int
    partition: int
    generation: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[_Union[RankResponse, _Mapping]] = ..., owner: _Optional[str] = ..., retry_pushback_ms: _Optional[int] = ..., partition: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class RankBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RankBatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RankBatchResult, _Mapping]]] = ...) -> None: ...

class InspectUserRequest(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    def __init__(self, user_id: _Optional[str] = ...) -> None: ...

class InspectUserResponse(_message.Message):
    __slots__ = ("user_id", "known", "position", "unlocked_blocks", "total_blocks", "note_count", "resident_tier", "last_ts_ms", "model_version")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    UNLOCKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOTE_COUNT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TIER_FIELD_NUMBER: _ClassVar[int]
    LAST_TS_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    known: bool
    position: int
    unlocked_blocks: int
    total_blocks: int
    note_count: int
    resident_tier: str
    last_ts_ms: int
    model_version: str
    def __init__(self, user_id: _Optional[str] = ..., known: _Optional[bool] = ..., position: _Optional[int] = ..., unlocked_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., note_count: _Optional[int] = ..., resident_tier: _Optional[str] = ..., last_ts_ms: _Optional[int] = ..., model_version: _Optional[str] = ...) -> None: ...

class RoutingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PartitionOwner(_message.Message):
    __slots__ = ("partition", "address")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    partition: int
    address: str
    def __init__(self, partition: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class RoutingResponse(_message.Message):
    __slots__ = ("generation", "partitions", "owners", "address", "model_version")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    partitions: int
    owners: _containers.RepeatedCompositeFieldContainer[PartitionOwner]
    address: str
    model_version: str
    def __init__(self, generation: _Optional[int] = ..., partitions: _Optional[int] = ..., owners: _Optional[_Iterable[_Union[PartitionOwner, _Mapping]]] = ..., address: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...
