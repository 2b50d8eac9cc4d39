from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("sender", "round", "step", "topology_hash", "manifest", "scalars", "total_bytes", "crc32", "wire_version", "compression", "count")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_HASH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    sender: str
    round: int
    step: int
    topology_hash: str
    manifest: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    scalars: _containers.ScalarMap[str, float]
    total_bytes: int
    crc32: int
    wire_version: int
    compression: str
    count: int
    def __init__(self, sender: _Optional[str] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., topology_hash: _Optional[str] = ..., manifest: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., scalars: _Optional[_Mapping[str, float]] = ..., total_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., wire_version: _Optional[int] = ..., compression: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: Header
    data: bytes
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("requester", "round", "step", "topology_hash")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_HASH_FIELD_NUMBER: _ClassVar[int]
    requester: str
    round: int
    step: int
    topology_hash: str
    def __init__(self, requester: _Optional[str] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., topology_hash: _Optional[str] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("requester",)
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    requester: str
    def __init__(self, requester: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("peer_id", "round", "topology_hash", "version")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_HASH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    topology_hash: str
    version: str
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., topology_hash: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...
