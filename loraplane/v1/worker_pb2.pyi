from loraplane.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("submit", "cancel_request_id", "tenant")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    submit: _common_pb2.GenerateRequest
    cancel_request_id: str
    tenant: RequestTenant
    def __init__(self, submit: _Optional[_Union[_common_pb2.GenerateRequest, _Mapping]] = ..., cancel_request_id: _Optional[str] = ..., tenant: _Optional[_Union[RequestTenant, _Mapping]] = ...) -> None: ...

class RequestTenant(_message.Message):
    __slots__ = ("name", "weight", "priority")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    priority: int
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class TenantService(_message.Message):
    __slots__ = ("name", "virtual_tokens", "prompt_tokens", "output_tokens", "queued", "running", "weight", "priority")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    virtual_tokens: float
    prompt_tokens: int
    output_tokens: int
    queued: int
    running: int
    weight: float
    priority: int
    def __init__(self, name: _Optional[str] = ..., virtual_tokens: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., weight: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class WorkerAdapterList(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterInfo, _Mapping]]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "n_slots", "slots_busy", "queue_depth", "queue_limit", "graph_reuses", "graph_rebuilds", "prefix_cache_entries", "prefix_cache_hit_tokens", "prompt_tokens_computed", "tokens_generated", "batching", "prefix_cache", "model", "device", "dtype", "adapter_ids", "node_budget", "adapter_bytes", "max_loras", "max_cpu_loras", "resident_adapters", "host_adapters", "known_adapters", "page_ins", "evictions", "page_in_bytes", "host_evictions", "fetches", "fetch_bytes", "fetch_failures", "pool_bytes", "resident_adapter_ids", "host_adapter_ids", "step_interval_p50_ms", "step_busy_p50_ms", "step_samples", "kv_cells_used", "kv_cells_total", "pinned_adapter_ids", "fairness", "tenants", "cuda_graphs_captured", "cuda_graph_replays", "cuda_graph_eager_fallbacks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    N_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_BUSY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    GRAPH_REUSES_FIELD_NUMBER: _ClassVar[int]
    GRAPH_REBUILDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_INS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_BUSY_P50_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PINNED_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_CAPTURED_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_REPLAYS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_EAGER_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    n_slots: int
    slots_busy: int
    queue_depth: int
    queue_limit: int
    graph_reuses: int
    graph_rebuilds: int
    prefix_cache_entries: int
    prefix_cache_hit_tokens: int
    prompt_tokens_computed: int
    tokens_generated: int
    batching: str
    prefix_cache: str
    model: str
    device: str
    dtype: str
    adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    node_budget: int
    adapter_bytes: int
    max_loras: int
    max_cpu_loras: int
    resident_adapters: int
    host_adapters: int
    known_adapters: int
    page_ins: int
    evictions: int
    page_in_bytes: int
    host_evictions: int
    fetches: int
    fetch_bytes: int
    fetch_failures: int
    pool_bytes: int
    resident_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    host_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    step_interval_p50_ms: float
    step_busy_p50_ms: float
    step_samples: int
    kv_cells_used: int
    kv_cells_total: int
    pinned_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    fairness: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantService]
    cuda_graphs_captured: int
    cuda_graph_replays: int
    cuda_graph_eager_fallbacks: int
    def __init__(self, worker_id: _Optional[str] = ..., n_slots: _Optional[int] = ..., slots_busy: _Optional[int] = ..., queue_depth: _Optional[int] = ..., queue_limit: _Optional[int] = ..., graph_reuses: _Optional[int] = ..., graph_rebuilds: _Optional[int] = ..., prefix_cache_entries: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., batching: _Optional[str] = ..., prefix_cache: _Optional[str] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., adapter_ids: _Optional[_Iterable[int]] = ..., node_budget: _Optional[int] = ..., adapter_bytes: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., resident_adapters: _Optional[int] = ..., host_adapters: _Optional[int] = ..., known_adapters: _Optional[int] = ..., page_ins: _Optional[int] = ..., evictions: _Optional[int] = ..., page_in_bytes: _Optional[int] = ..., host_evictions: _Optional[int] = ..., fetches: _Optional[int] = ..., fetch_bytes: _Optional[int] = ..., fetch_failures: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., resident_adapter_ids: _Optional[_Iterable[int]] = ..., host_adapter_ids: _Optional[_Iterable[int]] = ..., step_interval_p50_ms: _Optional[float] = ..., step_busy_p50_ms: _Optional[float] = ..., step_samples: _Optional[int] = ..., kv_cells_used: _Optional[int] = ..., kv_cells_total: _Optional[int] = ..., pinned_adapter_ids: _Optional[_Iterable[int]] = ..., fairness: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantService, _Mapping]]] = ..., cuda_graphs_captured: _Optional[int] = ..., cuda_graph_replays: _Optional[int] = ..., cuda_graph_eager_fallbacks: _Optional[int] = ...) -> None: ...
