from loraplane.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerHello(_message.Message):
    __slots__ = ("worker_id", "addr", "model", "model_sha256", "n_slots", "queue_limit", "holdings", "incarnation", "resident_adapter_ids", "host_adapter_ids", "paging", "draining", "supervisor_restarts", "n_ctx", "kv_cells_used", "kv_cells_total", "pinned_adapter_ids", "adapter_paging")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    N_SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SUPERVISOR_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PINNED_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PAGING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    addr: str
    model: str
    model_sha256: str
    n_slots: int
    queue_limit: int
    holdings: WorkerHoldings
    incarnation: str
    resident_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    host_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    paging: _common_pb2.WorkerPaging
    draining: bool
    supervisor_restarts: int
    n_ctx: int
    kv_cells_used: int
    kv_cells_total: int
    pinned_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter_paging: _containers.RepeatedCompositeFieldContainer[AdapterPagingCount]
    def __init__(self, worker_id: _Optional[str] = ..., addr: _Optional[str] = ..., model: _Optional[str] = ..., model_sha256: _Optional[str] = ..., n_slots: _Optional[int] = ..., queue_limit: _Optional[int] = ..., holdings: _Optional[_Union[WorkerHoldings, _Mapping]] = ..., incarnation: _Optional[str] = ..., resident_adapter_ids: _Optional[_Iterable[int]] = ..., host_adapter_ids: _Optional[_Iterable[int]] = ..., paging: _Optional[_Union[_common_pb2.WorkerPaging, _Mapping]] = ..., draining: _Optional[bool] = ..., supervisor_restarts: _Optional[int] = ..., n_ctx: _Optional[int] = ..., kv_cells_used: _Optional[int] = ..., kv_cells_total: _Optional[int] = ..., pinned_adapter_ids: _Optional[_Iterable[int]] = ..., adapter_paging: _Optional[_Iterable[_Union[AdapterPagingCount, _Mapping]]] = ...) -> None: ...

class WorkerHoldings(_message.Message):
    __slots__ = ("adapters", "draining_ids")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_IDS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[HeldAdapter]
    draining_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, adapters: _Optional[_Iterable[_Union[HeldAdapter, _Mapping]]] = ..., draining_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HeldAdapter(_message.Message):
    __slots__ = ("id", "sha256")
    ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    id: int
    sha256: str
    def __init__(self, id: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class AdapterPagingCount(_message.Message):
    __slots__ = ("adapter_id", "page_ins", "evictions")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_INS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    adapter_id: int
    page_ins: int
    evictions: int
    def __init__(self, adapter_id: _Optional[int] = ..., page_ins: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("sha256", "worker_id")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    worker_id: str
    def __init__(self, sha256: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class WorkerAck(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "joined")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    joined: bool
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., joined: _Optional[bool] = ...) -> None: ...
