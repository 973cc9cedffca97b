"""The shape check of a JSON body before it is parsed (server.body_bounds): values counted outside strings, the
member at fault named, arrays bounded."""

from __future__ import annotations

import json

import pytest

from server.body_bounds import body_fault


def fault(obj, max_values=1000, max_items=100):
    return body_fault(json.dumps(obj).encode(), max_values, max_items)


def test_a_body_within_the_bounds_passes():
    assert fault({"prompt": [[1] * 100] * 9, "max_tokens": 1}) is None
    assert fault({"prompt": "a, [b], {c}, " * 10_000}) is None  # commas and brackets inside strings are not values
    assert fault({"prompt": 'a\\", [1, 2, 3], "\\\\' * 2000}) is None  # nor are they after escaped quotes


@pytest.mark.parametrize("obj,field", [
    ({"max_tokens": 1, "prompt": [[1]] * 2000}, "prompt"),
    ({"messages": [{"role": "user", "content": "a,b"}] * 400, "model": "x"}, "messages"),
    ({"a": {"b": [1, 2]}, "input": [{"role": "user", "content": "}"}] * 400, "z": [1]}, "input"),
    ({"inputs": "x", "parameters": {"stop": ["a"] * 2000}}, "parameters")])
def test_too_many_values_name_the_largest_top_level_member(obj, field):
    message, got = fault(obj)
    assert got == field and f"`{field}`" in message and "at most 1000" in message


def test_a_long_array_is_named_by_its_path():
    assert fault({"prompt": [1] * 101})[1] == "prompt"
    assert fault({"prompt": [[1], [1] * 101]})[1] == "prompt.1"
    assert fault({"prompt": [1] * 100}) is None


def test_what_is_not_json_is_left_to_the_parser():
    for raw in (b'{"prompt": "open', b'{"prompt": [1, 2', b"[" * 5000):
        assert body_fault(raw, 10_000, 10_000) is None
    assert body_fault(b"[" * 5000, 100, 100)[1] is None  # too many values, and no member to name
    assert body_fault(b'{"a": 1, "prompt": [' + b"1," * 500, 100, 100)[1] == "prompt"  # left open


def test_too_many_objects_and_arrays_name_the_member_that_holds_them():
    """#32: 64 messages of 340 one-letter content parts (22k objects, 676 KB) were within the bound on values,
    and held the event loop 1.2 s before their 400: objects and arrays are bounded on their own."""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 340}] * 64,
             "stop": [[1]] * 30}
    message, field = body_fault(json.dumps(parts).encode(), 100_000, 1000, max_containers=2000)
    assert field == "messages" and "`messages`" in message and "21921 JSON objects and arrays" in message
    assert "at most 2000" in message
    assert body_fault(json.dumps(parts).encode(), 100_000, 1000, max_containers=21921) is None
    assert body_fault(json.dumps({"prompt": "{[" * 5000}).encode(), 100_000, 1000, max_containers=10) is None


CHAT_PARTS = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 340}] * 64,
                         "max_tokens": 1}).encode()


def test_the_server_refuses_a_body_of_more_objects_than_positions_naming_the_field():
    """The 676 KB body above gets 400 naming `messages` (as `input` on /v1/responses), before it is parsed:
    its 22k objects are past MAX_TOTAL_TOKENS plus 256 (4096 while the model loads)."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import load_settings

    client = TestClient(create_app(load_settings(), load_in_background=True))
    headers = {"content-type": "application/json"}
    for path, body, field in [("/v1/chat/completions", CHAT_PARTS, "messages"),
                              ("/v1/responses", CHAT_PARTS.replace(b'"messages"', b'"input"').replace(
                                  b'"text", "text"', b'"input_text", "text"'), "input")]:
        r = client.post(path, content=body, headers=headers)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field, (path, r.text[:300])
        assert f"`{field}`" in error["message"] and "JSON objects and arrays" in error["message"]
