"""Bounds on the shape of a JSON request body, checked before it is parsed and validated.

Parsing and validating a body take time in proportion to the number of JSON values in it: a 1.9 MB body of
474,985 one-token prompts held the event loop (``/health`` and every stream) for 2.6 s before its 400, when FastAPI
did both on the loop (a large body is now read in a worker thread: :mod:`server.api.threaded_body`; its time is
still the server's). A body is therefore measured first, from its bytes (C-speed byte counts, no
parse), and refused when it holds more values, more objects and arrays, or a longer array, than any request the
server could serve. Objects and arrays cost the most to validate (a 676 KB chat body of 22k one-letter content
parts, within the bound on values, held the loop for 1.2 s), and each one a servable request holds is a prompt,
a message, a content part or an input item, bar a few: so they are bounded by the model's positions.
"""

from __future__ import annotations

import json

def _items(outside: bytes) -> int:
    """Array elements and object members begun in ``outside`` (JSON text with its strings taken out): a comma
    before each but the first, and at most one first per container opened."""
    return outside.count(b",") + outside.count(b"[") + outside.count(b"{")


def _split(body: bytes) -> list[bytes] | None:
    """``body`` cut at its string delimiters: even items are the text outside strings, odd items the strings'
    contents (escapes taken out); ``None`` when a string is left open (invalid JSON, for the parser to report)."""
    parts = body.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')
    return parts if len(parts) % 2 else None


def _containers(outside: bytes) -> int:
    """Objects and arrays begun in ``outside`` (JSON text with its strings taken out)."""
    return outside.count(b"[") + outside.count(b"{")


def _largest_member(parts: list[bytes], containers: bool = False) -> str | None:
    """The top-level key whose value holds the most items (with ``containers``: the most objects and arrays;
    ``None`` when the body is not an object), from the text outside strings (each string one ``S``, a byte JSON
    never has outside strings), in a few tensor ops."""
    import torch

    text = torch.frombuffer(bytearray(b"S".join(parts[::2])), dtype=torch.uint8)
    opens, closes = (text == ord("[")) | (text == ord("{")), (text == ord("]")) | (text == ord("}"))
    depth = torch.cumsum(opens.int() - closes.int(), 0)  # after each byte
    commas = text == ord(",")
    keys = torch.nonzero((text == ord(":")) & (depth == 1)).flatten()  # the colons of the top-level members
    if not len(keys):
        return None
    ends = torch.nonzero((commas & (depth == 1)) | (closes & (depth == 0))).flatten()
    ends = torch.cat([ends, torch.tensor([len(text) - 1])])  # an object left open ends with the body
    items = torch.cumsum((opens if containers else commas | opens).int(), 0)
    ends = ends[torch.searchsorted(ends, keys)]
    strings = torch.cumsum((text == ord("S")).int(), 0)  # the key of a member: the last string before its colon
    best = int(torch.argmax(items[ends] - items[keys]))
    return parts[2 * int(strings[keys[best]] - 1) + 1].decode("utf-8", "replace")


def _long_array(node, max_items: int, path: str = "") -> tuple[str, int] | None:
    """The path (``prompt``, ``messages``, ``prompt.3``) and length of the first array in ``node`` longer than
    ``max_items``, or ``None``."""
    if isinstance(node, list):
        if len(node) > max_items:
            return path or "body", len(node)
        children = enumerate(node)
    elif isinstance(node, dict):
        children = node.items()
    else:
        return None
    for key, value in children:  # a path only for containers: a prompt's token ids are most of a large body
        if isinstance(value, (list, dict)) and (
                found := _long_array(value, max_items, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


def body_fault(body: bytes, max_values: int, max_items: int,
               max_containers: int | None = None) -> tuple[str, str | None] | None:
    """Why ``body`` (JSON text, as bytes) is refused before it is parsed for validation, or ``None``.

    Args:
        body: the request body.
        max_values: the most array elements and object members it may hold in all.
        max_items: the most elements any one of its arrays may hold.
        max_containers: the most objects and arrays it may hold in all (``None``: no bound).

    Returns:
        ``(message, field)``: ``field`` names the top-level member (or the array) at fault, ``None`` when the
        body is not an object. ``None`` when the body is within both bounds, or is not JSON (the parser
        reports that).

    Work: a few byte counts over the body; past a bound, a pass over its strings to name the member; within
    them, a parse (of at most ``max_values`` values).
    """
    parts = _split(body)
    if parts is None:
        return None
    outside = b"".join(parts[::2])  # one C-speed count over the text outside strings, not one per string
    containers = _containers(outside)
    if max_containers is not None and containers > max_containers:
        field = _largest_member(parts, containers=True)
        return (f"{f'`{field}`' if field else 'the body'} is too large: the body holds {containers} JSON objects "
                f"and arrays (messages, content parts, input items, prompts), at most {max_containers} are served",
                field)
    values = _items(outside)
    if values > max_values:
        field = _largest_member(parts)
        return (f"{f'`{field}`' if field else 'the body'} is too large: the body holds about {values} JSON "
                f"values, at most {max_values} are served", field)
    try:
        found = _long_array(json.loads(body), max_items)
    except (ValueError, RecursionError):  # not JSON, or nested too deep: the parser reports it
        return None
    if found is None:
        return None
    path, length = found
    return f"`{path}` has {length} items; at most {max_items} (MAX_TOTAL_TOKENS)", path
