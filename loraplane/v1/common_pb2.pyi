from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterScale(_message.Message):
    __slots__ = ("id", "scale", "name")
    ID_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    id: int
    scale: float
    name: str
    def __init__(self, id: _Optional[int] = ..., scale: _Optional[float] = ..., name: _Optional[str] = ...) -> None: ...

class AdapterMap(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AdapterScale]
    def __init__(self, entries: _Optional[_Iterable[_Union[AdapterScale, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "prompt_logprobs", "ignore_eos", "stop", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs_top", "response_format")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_TOP_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int
    prompt_logprobs: bool
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    prompt_logprobs_top: int
    response_format: ResponseFormat
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., prompt_logprobs_top: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "schema", "strict", "regex", "grammar", "name")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[ResponseFormat.Type]
        TYPE_JSON_OBJECT: _ClassVar[ResponseFormat.Type]
        TYPE_JSON_SCHEMA: _ClassVar[ResponseFormat.Type]
        TYPE_REGEX: _ClassVar[ResponseFormat.Type]
        TYPE_GRAMMAR: _ClassVar[ResponseFormat.Type]
    TYPE_UNSPECIFIED: ResponseFormat.Type
    TYPE_JSON_OBJECT: ResponseFormat.Type
    TYPE_JSON_SCHEMA: ResponseFormat.Type
    TYPE_REGEX: ResponseFormat.Type
    TYPE_GRAMMAR: ResponseFormat.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    type: ResponseFormat.Type
    schema: str
    strict: bool
    regex: str
    grammar: str
    name: str
    def __init__(self, type: _Optional[_Union[ResponseFormat.Type, str]] = ..., schema: _Optional[str] = ..., strict: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class StepTelemetry(_message.Message):
    __slots__ = ("batch_size", "batch_tokens", "n_adapter_sets", "graph_reused", "n_nodes", "node_budget", "batching")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_ADAPTER_SETS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_REUSED_FIELD_NUMBER: _ClassVar[int]
    N_NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    batch_tokens: int
    n_adapter_sets: int
    graph_reused: bool
    n_nodes: int
    node_budget: int
    batching: str
    def __init__(self, batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., n_adapter_sets: _Optional[int] = ..., graph_reused: _Optional[bool] = ..., n_nodes: _Optional[int] = ..., node_budget: _Optional[int] = ..., batching: _Optional[str] = ...) -> None: ...

class RequestTelemetry(_message.Message):
    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "cache_cleared", "cache_clear_reason", "prefix_cache", "alora_activation_pos", "adapter_set_fingerprint", "slot_id", "worker_id", "graph_reuses", "graph_rebuilds", "max_batch_size", "max_adapter_sets_in_batch", "adapters", "ttft_ms", "total_ms", "adapter_residency")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CLEARED_FIELD_NUMBER: _ClassVar[int]
    CACHE_CLEAR_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    ALORA_ACTIVATION_POS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GRAPH_REUSES_FIELD_NUMBER: _ClassVar[int]
    GRAPH_REBUILDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTER_SETS_IN_BATCH_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_prompt_tokens: int
    cache_cleared: bool
    cache_clear_reason: str
    prefix_cache: str
    alora_activation_pos: int
    adapter_set_fingerprint: str
    slot_id: int
    worker_id: str
    graph_reuses: int
    graph_rebuilds: int
    max_batch_size: int
    max_adapter_sets_in_batch: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterScale]
    ttft_ms: float
    total_ms: float
    adapter_residency: _containers.RepeatedCompositeFieldContainer[AdapterResidency]
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., cache_cleared: _Optional[bool] = ..., cache_clear_reason: _Optional[str] = ..., prefix_cache: _Optional[str] = ..., alora_activation_pos: _Optional[int] = ..., adapter_set_fingerprint: _Optional[str] = ..., slot_id: _Optional[int] = ..., worker_id: _Optional[str] = ..., graph_reuses: _Optional[int] = ..., graph_rebuilds: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_adapter_sets_in_batch: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterScale, _Mapping]]] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., adapter_residency: _Optional[_Iterable[_Union[AdapterResidency, _Mapping]]] = ...) -> None: ...

class AdapterResidency(_message.Message):
    __slots__ = ("id", "source", "wait_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    id: int
    source: str
    wait_ms: float
    def __init__(self, id: _Optional[int] = ..., source: _Optional[str] = ..., wait_ms: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "tokens", "adapters", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    tokens: TokenIds
    adapters: AdapterMap
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., adapters: _Optional[_Union[AdapterMap, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt_logprobs")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("has_logprob", "token_id", "logprob", "rank", "top")
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    has_logprob: bool
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, has_logprob: _Optional[bool] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GeneratedToken(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "top", "step")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    step: StepTelemetry
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., step: _Optional[_Union[StepTelemetry, _Mapping]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "text", "telemetry")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    text: str
    telemetry: RequestTelemetry
    def __init__(self, finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., telemetry: _Optional[_Union[RequestTelemetry, _Mapping]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("request_id", "started", "token", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    started: Started
    token: GeneratedToken
    finished: Finished
    def __init__(self, request_id: _Optional[str] = ..., started: _Optional[_Union[Started, _Mapping]] = ..., token: _Optional[_Union[GeneratedToken, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("id", "name", "path", "sha256", "arch", "alpha", "ranks", "target_tensors", "task_name", "prompt_prefix", "alora_invocation_tokens", "alora_invocation_text", "default_scale", "size_bytes", "n_nodes", "source_format", "pinned", "aliases")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TASK_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    ALORA_INVOCATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALORA_INVOCATION_TEXT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    N_NODES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    path: str
    sha256: str
    arch: str
    alpha: float
    ranks: _containers.RepeatedScalarFieldContainer[int]
    target_tensors: _containers.RepeatedScalarFieldContainer[str]
    task_name: str
    prompt_prefix: str
    alora_invocation_tokens: _containers.RepeatedScalarFieldContainer[int]
    alora_invocation_text: str
    default_scale: float
    size_bytes: int
    n_nodes: int
    source_format: str
    pinned: bool
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ..., arch: _Optional[str] = ..., alpha: _Optional[float] = ..., ranks: _Optional[_Iterable[int]] = ..., target_tensors: _Optional[_Iterable[str]] = ..., task_name: _Optional[str] = ..., prompt_prefix: _Optional[str] = ..., alora_invocation_tokens: _Optional[_Iterable[int]] = ..., alora_invocation_text: _Optional[str] = ..., default_scale: _Optional[float] = ..., size_bytes: _Optional[int] = ..., n_nodes: _Optional[int] = ..., source_format: _Optional[str] = ..., pinned: _Optional[bool] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("id", "sha256", "name", "server_path", "data", "source_format", "fetch_on_demand", "pinned")
    ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SERVER_PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    FETCH_ON_DEMAND_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    id: int
    sha256: str
    name: str
    server_path: str
    data: bytes
    source_format: str
    fetch_on_demand: bool
    pinned: bool
    def __init__(self, id: _Optional[int] = ..., sha256: _Optional[str] = ..., name: _Optional[str] = ..., server_path: _Optional[str] = ..., data: _Optional[bytes] = ..., source_format: _Optional[str] = ..., fetch_on_demand: _Optional[bool] = ..., pinned: _Optional[bool] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("id", "name")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

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

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
