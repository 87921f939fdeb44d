from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_UNSPECIFIED: _ClassVar[Action]
    ACTION_VIEW: _ClassVar[Action]
    ACTION_CLICK: _ClassVar[Action]
    ACTION_CART: _ClassVar[Action]
    ACTION_PURCHASE: _ClassVar[Action]
    ACTION_RATING: _ClassVar[Action]
    ACTION_OTHER: _ClassVar[Action]
ACTION_UNSPECIFIED: Action
ACTION_VIEW: Action
ACTION_CLICK: Action
ACTION_CART: Action
ACTION_PURCHASE: Action
ACTION_RATING: Action
ACTION_OTHER: Action

class Event(_message.Message):
    __slots__ = ("user_id", "item_id", "ts_ms", "action", "value", "session_id", "event_id")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    item_id: str
    ts_ms: int
    action: Action
    value: float
    session_id: str
    event_id: str
    def __init__(self, user_id: _Optional[str] = ..., item_id: _Optional[str] = ..., ts_ms: _Optional[int] = ..., action: _Optional[_Union[Action, str]] = ..., value: _Optional[float] = ..., session_id: _Optional[str] = ..., event_id: _Optional[str] = ...) -> None: ...
