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

class SparseTensor(_message.Message):
    __slots__ = ("name", "shape", "chunk_h", "chunk_w", "k", "index_coding", "indices", "value_encoding", "values", "scales")
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
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., chunk_h: _Optional[int] = ..., chunk_w: _Optional[int] = ..., k: _Optional[int] = ..., index_coding: _Optional[_Union[IndexCoding, str]] = ..., indices: _Optional[bytes] = ..., value_encoding: _Optional[_Union[ValueEncoding, str]] = ..., values: _Optional[bytes] = ..., scales: _Optional[bytes] = ...) -> None: ...

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
