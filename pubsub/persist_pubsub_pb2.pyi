from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message

DESCRIPTOR: _descriptor.FileDescriptor

class ProtoPushDiff(_message.Message):
    __slots__ = ("shard_id", "seqno", "pushed_at_us")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    SEQNO_FIELD_NUMBER: _ClassVar[int]
    PUSHED_AT_US_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    seqno: int
    pushed_at_us: int
    def __init__(self, shard_id: str | None = ..., seqno: int | None = ..., pushed_at_us: int | None = ...) -> None: ...

class ProtoSubscribe(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: str
    def __init__(self, shard: str | None = ...) -> None: ...

class ProtoUnsubscribe(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: str
    def __init__(self, shard: str | None = ...) -> None: ...

class ProtoPubSubMessage(_message.Message):
    __slots__ = ("push_diff", "subscribe", "unsubscribe")
    PUSH_DIFF_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    UNSUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    push_diff: ProtoPushDiff
    subscribe: ProtoSubscribe
    unsubscribe: ProtoUnsubscribe
    def __init__(self, push_diff: ProtoPushDiff | _Mapping | None = ..., subscribe: ProtoSubscribe | _Mapping | None = ..., unsubscribe: ProtoUnsubscribe | _Mapping | None = ...) -> None: ...
