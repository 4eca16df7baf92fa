from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IndexCoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INDEX_CODING_UNSPECIFIED: _ClassVar[IndexCoding]
    INDEX_CODING_PACKED: _ClassVar[IndexCoding]
    INDEX_CODING_ELIAS_FANO: _ClassVar[IndexCoding]
    INDEX_CODING_BITMAP: _ClassVar[IndexCoding]

class ValueEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_ENCODING_UNSPECIFIED: _ClassVar[ValueEncoding]
    VALUE_ENCODING_FP32: _ClassVar[ValueEncoding]
    VALUE_ENCODING_BF16: _ClassVar[ValueEncoding]
    VALUE_ENCODING_FP16: _ClassVar[ValueEncoding]
    VALUE_ENCODING_INT8: _ClassVar[ValueEncoding]
    VALUE_ENCODING_SIGN: _ClassVar[ValueEncoding]

class ValueCoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_CODING_PLAIN: _ClassVar[ValueCoding]
    VALUE_CODING_TOP_PLANE_DEFLATE: _ClassVar[ValueCoding]

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_NONE: _ClassVar[Refusal]
    REFUSAL_STALE: _ClassVar[Refusal]
    REFUSAL_FUTURE: _ClassVar[Refusal]
    REFUSAL_NOT_MEMBER: _ClassVar[Refusal]
    REFUSAL_DUPLICATE: _ClassVar[Refusal]
    REFUSAL_INVALID: _ClassVar[Refusal]
    REFUSAL_RESYNC: _ClassVar[Refusal]
    REFUSAL_BUSY: _ClassVar[Refusal]

class DhtKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DHT_KIND_UNSPECIFIED: _ClassVar[DhtKind]
    DHT_KIND_PART: _ClassVar[DhtKind]
    DHT_KIND_FETCH: _ClassVar[DhtKind]
    DHT_KIND_PARAMS: _ClassVar[DhtKind]
    DHT_KIND_REPLY: _ClassVar[DhtKind]
    DHT_KIND_PING: _ClassVar[DhtKind]
    DHT_KIND_CHECK: _ClassVar[DhtKind]
    DHT_KIND_STORE: _ClassVar[DhtKind]
    DHT_KIND_HELLO: _ClassVar[DhtKind]
    DHT_KIND_RECEIVED: _ClassVar[DhtKind]
INDEX_CODING_UNSPECIFIED: IndexCoding
INDEX_CODING_PACKED: IndexCoding
INDEX_CODING_ELIAS_FANO: IndexCoding
INDEX_CODING_BITMAP: IndexCoding
VALUE_ENCODING_UNSPECIFIED: ValueEncoding
VALUE_ENCODING_FP32: ValueEncoding
VALUE_ENCODING_BF16: ValueEncoding
VALUE_ENCODING_FP16: ValueEncoding
VALUE_ENCODING_INT8: ValueEncoding
VALUE_ENCODING_SIGN: ValueEncoding
VALUE_CODING_PLAIN: ValueCoding
VALUE_CODING_TOP_PLANE_DEFLATE: ValueCoding
REFUSAL_NONE: Refusal
REFUSAL_STALE: Refusal
REFUSAL_FUTURE: Refusal
REFUSAL_NOT_MEMBER: Refusal
REFUSAL_DUPLICATE: Refusal
REFUSAL_INVALID: Refusal
REFUSAL_RESYNC: Refusal
REFUSAL_BUSY: Refusal
DHT_KIND_UNSPECIFIED: DhtKind
DHT_KIND_PART: DhtKind
DHT_KIND_FETCH: DhtKind
DHT_KIND_PARAMS: DhtKind
DHT_KIND_REPLY: DhtKind
DHT_KIND_PING: DhtKind
DHT_KIND_CHECK: DhtKind
DHT_KIND_STORE: DhtKind
DHT_KIND_HELLO: DhtKind
DHT_KIND_RECEIVED: DhtKind

class SparseTensor(_message.Message):
    __slots__ = ("name", "shape", "chunk_h", "chunk_w", "k", "index_coding", "indices", "value_encoding", "values", "scales", "value_coding")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_H_FIELD_NUMBER: _ClassVar[int]
    CHUNK_W_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    INDEX_CODING_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUE_ENCODING_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    VALUE_CODING_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunk_h: int
    chunk_w: int
    k: int
    index_coding: IndexCoding
    indices: bytes
    value_encoding: ValueEncoding
    values: bytes
    scales: bytes
    value_coding: ValueCoding
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., chunk_h: _Optional[int] = ..., chunk_w: _Optional[int] = ..., k: _Optional[int] = ..., index_coding: _Optional[_Union[IndexCoding, str]] = ..., indices: _Optional[bytes] = ..., value_encoding: _Optional[_Union[ValueEncoding, str]] = ..., values: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., value_coding: _Optional[_Union[ValueCoding, str]] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("version", "step", "encoding", "tensors", "digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    encoding: ValueEncoding
    tensors: _containers.RepeatedCompositeFieldContainer[SparseTensor]
    digest: bytes
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., encoding: _Optional[_Union[ValueEncoding, str]] = ..., tensors: _Optional[_Iterable[_Union[SparseTensor, _Mapping]]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class PayloadPart(_message.Message):
    __slots__ = ("payload_digest", "index", "count", "total_bytes", "data")
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    payload_digest: bytes
    index: int
    count: int
    total_bytes: int
    data: bytes
    def __init__(self, payload_digest: _Optional[bytes] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DenseTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class Parameters(_message.Message):
    __slots__ = ("version", "round", "tensors", "param_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    round: int
    tensors: _containers.RepeatedCompositeFieldContainer[DenseTensor]
    param_digest: str
    def __init__(self, version: _Optional[int] = ..., round: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[DenseTensor, _Mapping]]] = ..., param_digest: _Optional[str] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ("peer_id", "public_key")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    public_key: bytes
    def __init__(self, peer_id: _Optional[str] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("peer_id", "probe", "public_key", "nonce", "signature", "protocol")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    probe: bool
    public_key: bytes
    nonce: bytes
    signature: bytes
    protocol: int
    def __init__(self, peer_id: _Optional[str] = ..., probe: bool = ..., public_key: _Optional[bytes] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., protocol: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("peer_id", "round", "run_config", "data_seed", "round_timeout_s", "heartbeat_interval_s", "total_rounds", "param_specs", "session", "protocol", "task_files")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DATA_SEED_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PARAM_SPECS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    TASK_FILES_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    run_config: str
    data_seed: int
    round_timeout_s: float
    heartbeat_interval_s: float
    total_rounds: int
    param_specs: str
    session: bytes
    protocol: int
    task_files: _containers.RepeatedCompositeFieldContainer[TaskFile]
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., run_config: _Optional[str] = ..., data_seed: _Optional[int] = ..., round_timeout_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., total_rounds: _Optional[int] = ..., param_specs: _Optional[str] = ..., session: _Optional[bytes] = ..., protocol: _Optional[int] = ..., task_files: _Optional[_Iterable[_Union[TaskFile, _Mapping]]] = ...) -> None: ...

class TaskFile(_message.Message):
    __slots__ = ("name", "size", "sha256", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: bytes
    data: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class TaskFiles(_message.Message):
    __slots__ = ("version", "files")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    version: int
    files: _containers.RepeatedCompositeFieldContainer[TaskFile]
    def __init__(self, version: _Optional[int] = ..., files: _Optional[_Iterable[_Union[TaskFile, _Mapping]]] = ...) -> None: ...

class TaskFilesRequest(_message.Message):
    __slots__ = ("peer_id", "signature", "counter")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    signature: bytes
    counter: int
    def __init__(self, peer_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., counter: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("peer_id", "round", "signature", "counter")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    signature: bytes
    counter: int
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., signature: _Optional[bytes] = ..., counter: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("round", "member")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    round: int
    member: bool
    def __init__(self, round: _Optional[int] = ..., member: bool = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("peer_id", "round", "signature", "counter")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    signature: bytes
    counter: int
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., signature: _Optional[bytes] = ..., counter: _Optional[int] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("left",)
    LEFT_FIELD_NUMBER: _ClassVar[int]
    left: bool
    def __init__(self, left: bool = ...) -> None: ...

class ParametersRequest(_message.Message):
    __slots__ = ("peer_id", "round", "resync", "signature", "counter")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    resync: bool
    signature: bytes
    counter: int
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., resync: bool = ..., signature: _Optional[bytes] = ..., counter: _Optional[int] = ...) -> None: ...

class SubmitPart(_message.Message):
    __slots__ = ("peer_id", "round", "param_digest", "loss", "part", "signature", "digest_follows", "samples", "need_s", "least_s", "train_s", "micro_batches", "compute_s")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NEED_S_FIELD_NUMBER: _ClassVar[int]
    LEAST_S_FIELD_NUMBER: _ClassVar[int]
    TRAIN_S_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    param_digest: str
    loss: float
    part: PayloadPart
    signature: bytes
    digest_follows: bool
    samples: int
    need_s: float
    least_s: float
    train_s: float
    micro_batches: int
    compute_s: float
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., param_digest: _Optional[str] = ..., loss: _Optional[float] = ..., part: _Optional[_Union[PayloadPart, _Mapping]] = ..., signature: _Optional[bytes] = ..., digest_follows: bool = ..., samples: _Optional[int] = ..., need_s: _Optional[float] = ..., least_s: _Optional[float] = ..., train_s: _Optional[float] = ..., micro_batches: _Optional[int] = ..., compute_s: _Optional[float] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted", "reason", "resync", "refusal", "open_round")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROUND_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    resync: bool
    refusal: Refusal
    open_round: int
    def __init__(self, accepted: bool = ..., reason: _Optional[str] = ..., resync: bool = ..., refusal: _Optional[_Union[Refusal, str]] = ..., open_round: _Optional[int] = ...) -> None: ...

class AggregateRequest(_message.Message):
    __slots__ = ("peer_id", "round", "submitting", "signature", "counter")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SUBMITTING_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    submitting: bool
    signature: bytes
    counter: int
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., submitting: bool = ..., signature: _Optional[bytes] = ..., counter: _Optional[int] = ...) -> None: ...

class AggregateHeader(_message.Message):
    __slots__ = ("round", "aborted", "contributors", "next_round_s")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_S_FIELD_NUMBER: _ClassVar[int]
    round: int
    aborted: bool
    contributors: _containers.RepeatedScalarFieldContainer[str]
    next_round_s: float
    def __init__(self, round: _Optional[int] = ..., aborted: bool = ..., contributors: _Optional[_Iterable[str]] = ..., next_round_s: _Optional[float] = ...) -> None: ...

class AggregateTrailer(_message.Message):
    __slots__ = ("param_digest",)
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    param_digest: str
    def __init__(self, param_digest: _Optional[str] = ...) -> None: ...

class AggregateChunk(_message.Message):
    __slots__ = ("header", "part", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: AggregateHeader
    part: PayloadPart
    trailer: AggregateTrailer
    def __init__(self, header: _Optional[_Union[AggregateHeader, _Mapping]] = ..., part: _Optional[_Union[PayloadPart, _Mapping]] = ..., trailer: _Optional[_Union[AggregateTrailer, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("detail",)
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    detail: bool
    def __init__(self, detail: bool = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("round", "phase", "members", "submitted", "seconds_left", "param_digest", "bytes_up", "bytes_down", "last_loss", "rounds_closed", "rounds_aborted", "rejected", "resyncs", "detail_json")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    round: int
    phase: str
    members: _containers.RepeatedScalarFieldContainer[str]
    submitted: int
    seconds_left: float
    param_digest: str
    bytes_up: int
    bytes_down: int
    last_loss: float
    rounds_closed: int
    rounds_aborted: int
    rejected: int
    resyncs: int
    detail_json: str
    def __init__(self, round: _Optional[int] = ..., phase: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., submitted: _Optional[int] = ..., seconds_left: _Optional[float] = ..., param_digest: _Optional[str] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., last_loss: _Optional[float] = ..., rounds_closed: _Optional[int] = ..., rounds_aborted: _Optional[int] = ..., rejected: _Optional[int] = ..., resyncs: _Optional[int] = ..., detail_json: _Optional[str] = ...) -> None: ...

class DhtMessage(_message.Message):
    __slots__ = ("run", "round", "sender", "kind", "slice", "num_slices", "members_digest", "contributors", "error", "sent_at", "part", "signature", "mac", "call", "ahead", "samples")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    run: str
    round: int
    sender: str
    kind: DhtKind
    slice: int
    num_slices: int
    members_digest: str
    contributors: _containers.RepeatedScalarFieldContainer[str]
    error: str
    sent_at: float
    part: PayloadPart
    signature: bytes
    mac: bytes
    call: int
    ahead: bool
    samples: int
    def __init__(self, run: _Optional[str] = ..., round: _Optional[int] = ..., sender: _Optional[str] = ..., kind: _Optional[_Union[DhtKind, str]] = ..., slice: _Optional[int] = ..., num_slices: _Optional[int] = ..., members_digest: _Optional[str] = ..., contributors: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., sent_at: _Optional[float] = ..., part: _Optional[_Union[PayloadPart, _Mapping]] = ..., signature: _Optional[bytes] = ..., mac: _Optional[bytes] = ..., call: _Optional[int] = ..., ahead: bool = ..., samples: _Optional[int] = ...) -> None: ...
