from loraplane.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterList(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterInfo, _Mapping]]] = ...) -> None: ...

class HeldAdapter(_message.Message):
    __slots__ = ("id", "sha256")
    ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    id: int
    sha256: str
    def __init__(self, id: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class WorkerHoldings(_message.Message):
    __slots__ = ("adapters", "draining_ids")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_IDS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[HeldAdapter]
    draining_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, adapters: _Optional[_Iterable[_Union[HeldAdapter, _Mapping]]] = ..., draining_ids: _Optional[_Iterable[int]] = ...) -> None: ...

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
    paging: WorkerPaging
    draining: bool
    supervisor_restarts: int
    n_ctx: int
    kv_cells_used: int
    kv_cells_total: int
    pinned_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter_paging: _containers.RepeatedCompositeFieldContainer[AdapterPagingCount]
    def __init__(self, worker_id: _Optional[str] = ..., addr: _Optional[str] = ..., model: _Optional[str] = ..., model_sha256: _Optional[str] = ..., n_slots: _Optional[int] = ..., queue_limit: _Optional[int] = ..., holdings: _Optional[_Union[WorkerHoldings, _Mapping]] = ..., incarnation: _Optional[str] = ..., resident_adapter_ids: _Optional[_Iterable[int]] = ..., host_adapter_ids: _Optional[_Iterable[int]] = ..., paging: _Optional[_Union[WorkerPaging, _Mapping]] = ..., draining: _Optional[bool] = ..., supervisor_restarts: _Optional[int] = ..., n_ctx: _Optional[int] = ..., kv_cells_used: _Optional[int] = ..., kv_cells_total: _Optional[int] = ..., pinned_adapter_ids: _Optional[_Iterable[int]] = ..., adapter_paging: _Optional[_Iterable[_Union[AdapterPagingCount, _Mapping]]] = ...) -> None: ...

class AdapterPagingCount(_message.Message):
    __slots__ = ("adapter_id", "page_ins", "evictions")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_INS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    adapter_id: int
    page_ins: int
    evictions: int
    def __init__(self, adapter_id: _Optional[int] = ..., page_ins: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class WorkerPaging(_message.Message):
    __slots__ = ("max_loras", "max_cpu_loras", "resident", "host", "page_ins", "evictions", "fetches", "fetch_bytes", "page_in_bytes", "host_evictions")
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PAGE_INS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    max_loras: int
    max_cpu_loras: int
    resident: int
    host: int
    page_ins: int
    evictions: int
    fetches: int
    fetch_bytes: int
    page_in_bytes: int
    host_evictions: int
    def __init__(self, max_loras: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., resident: _Optional[int] = ..., host: _Optional[int] = ..., page_ins: _Optional[int] = ..., evictions: _Optional[int] = ..., fetches: _Optional[int] = ..., fetch_bytes: _Optional[int] = ..., page_in_bytes: _Optional[int] = ..., host_evictions: _Optional[int] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("sha256", "worker_id")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    worker_id: str
    def __init__(self, sha256: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("id", "pinned", "name")
    ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    id: int
    pinned: bool
    name: str
    def __init__(self, id: _Optional[int] = ..., pinned: _Optional[bool] = ..., name: _Optional[str] = ...) -> None: ...

class WorkerAck(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "joined")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    joined: bool
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., joined: _Optional[bool] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "addr", "state", "last_heartbeat_age_s", "adapter_ids", "model", "n_slots", "in_flight", "restarts", "draining_adapter_ids", "paging", "resident_adapter_ids", "host_adapter_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    N_SLOTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGING_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    addr: str
    state: str
    last_heartbeat_age_s: float
    adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    model: str
    n_slots: int
    in_flight: int
    restarts: int
    draining_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    paging: WorkerPaging
    resident_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    host_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., addr: _Optional[str] = ..., state: _Optional[str] = ..., last_heartbeat_age_s: _Optional[float] = ..., adapter_ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., n_slots: _Optional[int] = ..., in_flight: _Optional[int] = ..., restarts: _Optional[int] = ..., draining_adapter_ids: _Optional[_Iterable[int]] = ..., paging: _Optional[_Union[WorkerPaging, _Mapping]] = ..., resident_adapter_ids: _Optional[_Iterable[int]] = ..., host_adapter_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerList(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("name", "weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute", "key_count", "usage")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    KEY_COUNT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    priority: int
    max_concurrent: int
    tokens_per_minute: int
    requests_per_minute: int
    key_count: int
    usage: TenantUsage
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., priority: _Optional[int] = ..., max_concurrent: _Optional[int] = ..., tokens_per_minute: _Optional[int] = ..., requests_per_minute: _Optional[int] = ..., key_count: _Optional[int] = ..., usage: _Optional[_Union[TenantUsage, _Mapping]] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("in_flight", "tokens_available", "requests_available", "requests_total", "tokens_total", "rejected_total")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    tokens_available: float
    requests_available: float
    requests_total: int
    tokens_total: int
    rejected_total: int
    def __init__(self, in_flight: _Optional[int] = ..., tokens_available: _Optional[float] = ..., requests_available: _Optional[float] = ..., requests_total: _Optional[int] = ..., tokens_total: _Optional[int] = ..., rejected_total: _Optional[int] = ...) -> None: ...

class TenantLimits(_message.Message):
    __slots__ = ("weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    weight: float
    priority: int
    max_concurrent: int
    tokens_per_minute: int
    requests_per_minute: int
    def __init__(self, weight: _Optional[float] = ..., priority: _Optional[int] = ..., max_concurrent: _Optional[int] = ..., tokens_per_minute: _Optional[int] = ..., requests_per_minute: _Optional[int] = ...) -> None: ...

class AddTenantRequest(_message.Message):
    __slots__ = ("name", "limits", "api_key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    limits: TenantLimits
    api_key: str
    def __init__(self, name: _Optional[str] = ..., limits: _Optional[_Union[TenantLimits, _Mapping]] = ..., api_key: _Optional[str] = ...) -> None: ...

class AddTenantResponse(_message.Message):
    __slots__ = ("tenant", "api_key")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    api_key: str
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ..., api_key: _Optional[str] = ...) -> None: ...

class UpdateTenantRequest(_message.Message):
    __slots__ = ("name", "limits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    limits: TenantLimits
    def __init__(self, name: _Optional[str] = ..., limits: _Optional[_Union[TenantLimits, _Mapping]] = ...) -> None: ...

class UpdateTenantResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ...) -> None: ...

class RemoveTenantRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveTenantResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
