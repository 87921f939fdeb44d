from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from models.sequences import ACTIONS
from proto.recmem.v1 import event_pb2
from streams.codec import action_from_wire, action_to_wire, decode_event, encode_event, make_event

ids = st.text(min_size=1, max_size=40)


@given(
    user=ids,
    item=ids,
    ts=st.integers(min_value=1, max_value=2**62),
    action=st.sampled_from(ACTIONS),
    value=st.floats(allow_nan=False, allow_infinity=False, width=32),
    session=st.none() | ids,
)
def test_round_trip(user, item, ts, action, value, session):
    key, value_bytes = encode_event(make_event(user, item, ts, action, value, session))
    assert key == user.encode()
    back = decode_event(value_bytes)
    assert (back.user_id, back.item_id, back.ts_ms) == (user, item, ts)
    assert ACTIONS[action_from_wire(back.action)] == action
    assert back.value == value
    assert back.HasField("session_id") == (session is not None)
    if session is not None:
        assert back.session_id == session


def test_action_enum_follows_actions_order():
    for i, name in enumerate(ACTIONS):
        wire = action_to_wire(name)
        assert event_pb2.Action.Name(wire) == f"ACTION_{name.upper()}"
        assert action_to_wire(i) == wire
        assert action_from_wire(wire) == i
    assert action_from_wire(event_pb2.ACTION_UNSPECIFIED) == ACTIONS.index("other")
    assert action_from_wire(len(ACTIONS) + 1) is None


def test_bad_action_names_are_refused():
    with pytest.raises(ValueError, match="unknown action"):
        action_to_wire("like")
    with pytest.raises(ValueError, match="outside"):
        action_to_wire(len(ACTIONS))
