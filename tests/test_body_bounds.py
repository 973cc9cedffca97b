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
