from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("page_hashes",)
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, page_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("held", "prefix_pages")
    HELD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedScalarFieldContainer[bool]
    prefix_pages: int
    def __init__(self, held: _Optional[_Iterable[bool]] = ..., prefix_pages: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("page_hashes", "max_chunk_bytes")
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    def __init__(self, page_hashes: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class PageHeader(_message.Message):
    __slots__ = ("page_hash", "parent_hash", "token_ids", "lora_id", "dtype", "shape", "nbytes", "checksum", "tier")
    PAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    page_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_id: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: int
    tier: str
    def __init__(self, page_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., lora_id: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("page_index", "header", "offset", "missing", "data")
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    page_index: int
    header: PageHeader
    offset: int
    missing: bool
    data: bytes
    def __init__(self, page_index: _Optional[int] = ..., header: _Optional[_Union[PageHeader, _Mapping]] = ..., offset: _Optional[int] = ..., missing: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("inserted",)
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    inserted: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, inserted: _Optional[_Iterable[bool]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("page_hashes", "num_tokens", "page_size", "allow_pull", "role", "policy", "request_id", "tenant", "after", "split")
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PULL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    page_size: int
    allow_pull: bool
    role: str
    policy: str
    request_id: str
    tenant: str
    after: _containers.RepeatedCompositeFieldContainer[ReportMark]
    split: bool
    def __init__(self, page_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., allow_pull: _Optional[bool] = ..., role: _Optional[str] = ..., policy: _Optional[str] = ..., request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., after: _Optional[_Iterable[_Union[ReportMark, _Mapping]]] = ..., split: _Optional[bool] = ...) -> None: ...

class ReportMark(_message.Message):
    __slots__ = ("worker_id", "incarnation", "seq")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    seq: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker_id", "worker_address", "matched_pages", "peer_worker_id", "peer_address", "peer_pages", "policy", "total_pages", "degraded", "cost", "promote_pages", "request_id", "decode")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_PAGES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_PAGES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_address: str
    matched_pages: int
    peer_worker_id: str
    peer_address: str
    peer_pages: int
    policy: str
    total_pages: int
    degraded: bool
    cost: float
    promote_pages: int
    request_id: str
    decode: RouteResponse
    def __init__(self, worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., matched_pages: _Optional[int] = ..., peer_worker_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., peer_pages: _Optional[int] = ..., policy: _Optional[str] = ..., total_pages: _Optional[int] = ..., degraded: _Optional[bool] = ..., cost: _Optional[float] = ..., promote_pages: _Optional[int] = ..., request_id: _Optional[str] = ..., decode: _Optional[_Union[RouteResponse, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "address", "capacity", "incarnation", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    capacity: int
    incarnation: str
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity: _Optional[int] = ..., incarnation: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("needs_snapshot", "heartbeat_interval_s", "heartbeat_timeout_s")
    NEEDS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    needs_snapshot: bool
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    def __init__(self, needs_snapshot: _Optional[bool] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ...) -> None: ...

class WorkerLoadReport(_message.Message):
    __slots__ = ("active_prefill_tokens", "active_decode_pages", "free_pages", "total_pages", "active_requests")
    ACTIVE_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_DECODE_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    active_prefill_tokens: int
    active_decode_pages: int
    free_pages: int
    total_pages: int
    active_requests: int
    def __init__(self, active_prefill_tokens: _Optional[int] = ..., active_decode_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., active_requests: _Optional[int] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("batch", "worker_id", "batches", "load", "outcomes")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    batch: bytes
    worker_id: str
    batches: _containers.RepeatedScalarFieldContainer[bytes]
    load: WorkerLoadReport
    outcomes: _containers.RepeatedCompositeFieldContainer[RouteOutcomeReport]
    def __init__(self, batch: _Optional[bytes] = ..., worker_id: _Optional[str] = ..., batches: _Optional[_Iterable[bytes]] = ..., load: _Optional[_Union[WorkerLoadReport, _Mapping]] = ..., outcomes: _Optional[_Iterable[_Union[RouteOutcomeReport, _Mapping]]] = ...) -> None: ...

class RouteOutcomeReport(_message.Message):
    __slots__ = ("promised_local", "promised_pull", "realized_local", "realized_pull")
    PROMISED_LOCAL_FIELD_NUMBER: _ClassVar[int]
    PROMISED_PULL_FIELD_NUMBER: _ClassVar[int]
    REALIZED_LOCAL_FIELD_NUMBER: _ClassVar[int]
    REALIZED_PULL_FIELD_NUMBER: _ClassVar[int]
    promised_local: int
    promised_pull: int
    realized_local: int
    realized_pull: int
    def __init__(self, promised_local: _Optional[int] = ..., promised_pull: _Optional[int] = ..., realized_local: _Optional[int] = ..., realized_pull: _Optional[int] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("resync", "results")
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    resync: bool
    results: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, resync: _Optional[bool] = ..., results: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "workers", "shards", "replicas")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    workers: int
    shards: int
    replicas: int
    def __init__(self, serving: _Optional[bool] = ..., workers: _Optional[int] = ..., shards: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...
