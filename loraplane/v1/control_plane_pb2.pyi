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

class PinRequest(_message.Message):
    __slots__ = ("id", "pinned", "name")
    ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    id: int
    pinned: bool
    name: str
    def __init__(self, id: _Optional[int] = ..., pinned: _Optional[bool] = ..., name: _Optional[str] = ...) -> None: ...

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
    paging: _common_pb2.WorkerPaging
    resident_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    host_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., addr: _Optional[str] = ..., state: _Optional[str] = ..., last_heartbeat_age_s: _Optional[float] = ..., adapter_ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., n_slots: _Optional[int] = ..., in_flight: _Optional[int] = ..., restarts: _Optional[int] = ..., draining_adapter_ids: _Optional[_Iterable[int]] = ..., paging: _Optional[_Union[_common_pb2.WorkerPaging, _Mapping]] = ..., resident_adapter_ids: _Optional[_Iterable[int]] = ..., host_adapter_ids: _Optional[_Iterable[int]] = ...) -> None: ...

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
