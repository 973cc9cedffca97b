"""Tool calls on ``/v1/chat/completions``: ``tools`` into the prompt, ``tool_choice`` into a grammar or a parser,
and the model's output into OpenAI's ``tool_calls`` (whole, or as stream deltas).

``tool_choice``:

* ``"none"``: the tools are in the prompt; the output is plain content.
* ``"auto"`` (the default with tools): the output is parsed for calls in the hermes format that SmolLM2 and most
  tool-trained templates use, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the JSON may also be a
  list of calls), or a bare JSON object (or list) of such calls; a call names one of the tools. Found: the answer
  carries ``tool_calls`` (the text outside the tags, if any, as ``content``) and ``finish_reason`` ``tool_calls``.
* ``"required"``: the output is constrained to a JSON list of one or more calls ``{"name", "arguments"}``, each
  naming a tool and its arguments following that tool's ``parameters`` schema (one call with
  ``parallel_tool_calls: false``).
* ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's arguments (its ``parameters``
  schema), answered as one call of N.

The tools reach the prompt through the tokenizer's chat template (``apply_chat_template(tools=...)``); a template
that does not render them (its text is the same with and without) gets them as a system turn in the hermes format,
and earlier assistant calls as ``<tool_call>`` text, so the model always sees them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from server.api.openai_schemas import (ChatMessage, ChatRequest, DeltaFunction, DeltaToolCall, ResponseToolCall,
                                       ToolCallFunction)
from server.api.structured import NO_GRAMMAR, checked, json_schema_grammar
from server.engine.grammar import schema_text
from server.service import InvalidRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT = {"type": "object"}
TOOLS_SYSTEM = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
                "XML tags. You may call one or more functions to assist with the user query. For each function call, "
                "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
                "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>\n"
                "<tools>\n{tools}\n</tools>")
"""The system text that carries the tools to a model whose template does not render them (the hermes format)."""


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for.

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        names: the tools' names, in order.
        named: the function a ``named`` choice calls.
        single: at most one call (``parallel_tool_calls: false``).
        grammar: the engine's grammar fields for ``required`` and ``named`` (``("", "")`` otherwise).
    """

    mode: str = "none"
    names: tuple[str, ...] = ()
    named: str | None = None
    single: bool = False
    grammar: tuple[str, str] = NO_GRAMMAR

    @property
    def calls(self) -> bool:
        """Whether the answer may carry ``tool_calls``."""
        return self.mode != "none"


def plan(body: ChatRequest, constrained: bool, parser: str = "hermes") -> ToolPlan:
    """Check a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` and say what they ask.

    Args:
        body: the request.
        constrained: whether ``response_format`` already constrains the output.
        parser: ``TOOL_CALL_PARSER``: ``hermes`` parses ``auto`` answers; ``none`` refuses ``auto`` (given, or the
            default with ``tools``), as vLLM does without ``--tool-call-parser``.

    Raises:
        InvalidRequest: naming the field: two tools with one name, a ``parameters`` schema that cannot be
            followed, a ``tool_choice`` other than ``none`` without ``tools``, a named function that is not among
            them, ``required``/named beside a ``response_format`` that constrains, ``parallel_tool_calls``
            without tools.
    """
    tools = body.tools or []
    names = tuple(t.function.name for t in tools)
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"`tools[{i}].function.name` {name!r} names two tools", f"tools[{i}].function.name")
    schemas = []
    for i, t in enumerate(tools):
        params = t.function.parameters if t.function.parameters is not None else ANY_OBJECT
        if params.get("type", "object") != "object":
            raise InvalidRequest(f"`tools[{i}].function.parameters` must be a schema of type object",
                                 f"tools[{i}].function.parameters")
        json_schema_grammar(params, f"tools[{i}].function.parameters")
        schemas.append(params)
    choice = body.tool_choice
    named, field = None, ""
    if choice is None:
        mode = "auto" if tools else "none"
    elif not isinstance(choice, str):
        mode, named, field = "named", choice.function.name, "tool_choice.function.name"
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:  # TGI's: a function's name as a plain string (what its client sends)
        if tools and choice not in names:
            raise InvalidRequest(f"`tool_choice` {choice!r} is none of `none`, `auto` and `required` and names no "
                                 f"function of `tools` ({', '.join(names)})", "tool_choice")
        mode, named, field = "named", choice, "tool_choice"
    if body.parallel_tool_calls is not None and not tools:
        raise InvalidRequest("`parallel_tool_calls` needs `tools`", "parallel_tool_calls")
    if mode != "none" and not tools:
        raise InvalidRequest(f"`tool_choice` {choice if isinstance(choice, str) else mode!r} needs `tools`",
                             "tool_choice")
    if mode == "auto" and parser == "none":
        raise InvalidRequest("`tool_choice` \"auto\" (the default with `tools`) needs a tool-call parser, and this "
                             "server runs with TOOL_CALL_PARSER=none: start it with TOOL_CALL_PARSER=hermes, or send "
                             "`tool_choice` \"required\", \"none\" or a named function", "tool_choice")
    if mode in ("required", "named") and constrained:
        raise InvalidRequest(f"`tool_choice` {mode!r} constrains the output; it cannot go with a `response_format` "
                             "(or vLLM's `structured_outputs`, `guided_*`) that does", "tool_choice")
    single = body.parallel_tool_calls is False
    if mode == "named":
        if named not in names:
            raise InvalidRequest(f"`{field}` {named!r} is not among `tools` ({', '.join(names)})", field)
        return ToolPlan("named", names, named, True, checked("json_schema", schema_text(schemas[names.index(named)]),
                                                              field))
    if mode == "required":  # each tool's parameters under $defs, their own local $refs rebased there
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/t{i}"}},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for i, n in enumerate(names)]}
        array = {"$defs": {f"t{i}": rebased(s, f"#/$defs/t{i}") for i, s in enumerate(schemas)},
                 "type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if single else {})}
        return ToolPlan("required", names, None, single, checked("json_schema", schema_text(array), "tools"))
    return ToolPlan(mode, names, None, single)


def rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local references (``#``, ``#/...``) pointing under ``root`` (a JSON pointer such as
    ``#/$defs/t0``), for a schema placed inside a larger one: a tool's ``parameters`` with ``$defs`` of its own,
    as pydantic writes them for nested models."""
    if isinstance(schema, list):
        return [rebased(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rebased(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


# ---- the prompt -------------------------------------------------------------------------------------

def tool_dicts(body: ChatRequest) -> list[dict]:
    """The tools as the chat template takes them (OpenAI's shape)."""
    return [t.model_dump(exclude_none=True) for t in body.tools or []]


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_STRICT = json.JSONDecoder(parse_constant=_no_constant)
"""JSON as OpenAI's ``arguments`` must be: no ``NaN`` or ``Infinity``, which Python's reader takes."""


def strict_json(text: str, at: int | None = None) -> Any:
    """``text`` parsed as strict JSON (``NaN`` and ``Infinity`` refused), or with ``at`` the value that starts
    there and where it ends (``raw_decode``).

    Raises:
        ValueError: not strict JSON, or nested too deeply for Python's reader (its ``RecursionError``: a model's
            ``[[[[...`` output, or a client's).
    """
    try:
        return _STRICT.decode(text) if at is None else _STRICT.raw_decode(text, at)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _arguments(text: str) -> Any:
    try:
        return strict_json(text)
    except ValueError:
        return text


def check_turns(messages: list[ChatMessage]) -> None:
    """Refuse a conversation's tool turns as OpenAI does: a ``tool`` turn without ``tool_call_id`` or answering no
    earlier call, and an assistant call whose ``arguments`` is not JSON.

    Raises:
        InvalidRequest: naming the message's field (``messages[i].tool_call_id``, ...).
    """
    calls: set[str] = set()
    for i, m in enumerate(messages):
        for j, c in enumerate(m.tool_calls or []):
            try:
                strict_json(c.function.arguments)
            except (TypeError, ValueError):
                field = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise InvalidRequest(f"`{field}` must be JSON text", field) from None
            calls.add(c.id)
        if m.role == "tool":
            field = f"messages[{i}].tool_call_id"
            if m.tool_call_id is None:
                raise InvalidRequest(f"`{field}` is required in a `tool` message", field)
            if m.tool_call_id not in calls:
                raise InvalidRequest(f"`{field}` {m.tool_call_id!r} answers no earlier assistant `tool_calls`", field)


def turns(messages: list[ChatMessage], calls_as_text: bool = False, drop_calls: bool = False) -> list[dict]:
    """The messages as the chat template takes them: an assistant's ``tool_calls`` with their arguments parsed (as
    vLLM hands them to templates), or, with ``calls_as_text``, written into its content as ``<tool_call>`` text,
    or with ``drop_calls`` left out (to see whether a template renders them); a tool turn with its
    ``tool_call_id``."""
    out = []
    for m in messages:
        turn: dict = {"role": m.role, "content": m.text()}
        if m.tool_calls and not drop_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                     for c in m.tool_calls]
            if calls_as_text:
                text = "\n".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}\n{CLOSE}"
                                 for c in calls)
                turn["content"] = (turn["content"] + "\n" + text).strip()
            else:
                turn["tool_calls"] = calls
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        out.append(turn)
    return out


def with_tools_system(rendered_turns: list[dict], tools: list[dict], in_user_turn: bool = False) -> list[dict]:
    """``rendered_turns`` with the tools in a system turn (:data:`TOOLS_SYSTEM`), before a system turn's own text;
    with ``in_user_turn``, before the first user turn's text instead (a template that refuses system turns)."""
    text = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
    roles = ("user",) if in_user_turn else ("system", "developer")
    at = next((i for i, t in enumerate(rendered_turns) if t["role"] in roles), None)
    if at is not None and (in_user_turn or at == 0):
        turn = rendered_turns[at]
        return [*rendered_turns[:at], {**turn, "content": text + "\n\n" + turn["content"]}, *rendered_turns[at + 1:]]
    return [{"role": "system", "content": text}, *rendered_turns]


# ---- the answer -------------------------------------------------------------------------------------

def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(obj: Any, names: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one parsed call, or None when it is not a call of a known tool."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = strict_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    try:  # NaN and Infinity, which Python's JSON reads, are not JSON: such arguments are no call
        return obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None


def _calls_in(text: str, names: tuple[str, ...]) -> list[tuple[str, str]] | None:
    """The calls a JSON text holds (one object or a list of them), or None when it holds something else."""
    try:
        value = strict_json(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v, names) for v in items]
    return calls if calls and all(c is not None for c in calls) else None


def _complete_items(text: str, names: tuple[str, ...]) -> list[tuple[str, str]] | None:
    """The whole calls at the start of a JSON list cut short (an output that ran out of tokens), or None."""
    at, calls = text.find("[") + 1, []
    if at == 0 or text[:at - 1].strip():
        return None
    while True:
        while at < len(text) and text[at] in " \n\t,":
            at += 1
        try:
            value, at = strict_json(text, at)
        except ValueError:
            break
        call = _as_call(value, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


_TAGGED = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def parse(text: str, tools: ToolPlan) -> tuple[str | None, list[tuple[str, str]]]:
    """The content and the calls of a finished output.

    Args:
        text: the choice's whole output text.
        tools: the request's plan.

    Returns:
        ``(content, [(name, arguments JSON), ...])``; no calls: ``(text, [])``. A ``named`` choice is its call
        whatever the text (a truncated output gives truncated arguments); ``required`` gives the whole calls it
        parses (of an output cut short by ``max_tokens``, those before the cut); ``auto`` the calls (``auto``: only calls of known tools; the text outside the tags is the content, None if blank).
    """
    if tools.mode == "named":
        return None, [(tools.named, text)]
    if tools.mode == "none":
        return text, []
    if tools.mode == "required":
        calls = _calls_in(text, tools.names) or _complete_items(text, tools.names)
        return (None, calls[:1] if tools.single else calls) if calls else (text, [])
    calls, spans = [], []
    for match in _TAGGED.finditer(text):
        found = _calls_in(match.group(1).strip(), tools.names)
        if found:
            calls += found
            spans.append(match.span())
    if not calls:
        bare = _calls_in(text.strip(), tools.names)
        if bare:
            return None, bare[:1] if tools.single else bare
        return text, []
    rest, last = [], 0
    for start, end in spans:
        rest.append(text[last:start])
        last = end
    rest.append(text[last:])
    content = "".join(rest).strip()
    return content or None, calls[:1] if tools.single else calls


def finish_reason(reason: str, called: bool) -> str:
    """A choice's ``finish_reason``: ``tool_calls`` when it made calls, unless ``max_tokens`` cut it (``length``)."""
    return "tool_calls" if called and reason != "length" else reason


def response_calls(calls: list[tuple[str, str]]) -> list[ResponseToolCall]:
    return [ResponseToolCall(id=call_id(), function=ToolCallFunction(name=n, arguments=a)) for n, a in calls]


def delta_calls(calls: list[tuple[str, str]], first: int = 0) -> list[DeltaToolCall]:
    """Whole calls as stream deltas (each call's one delta carries its id, type, name and arguments)."""
    return [DeltaToolCall(index=first + i, id=call_id(), type="function", function=DeltaFunction(name=n, arguments=a))
            for i, (n, a) in enumerate(calls)]


@dataclass
class ToolStream:
    """One choice's stream of text turned into OpenAI deltas: ``content`` pieces and ``tool_calls`` pieces.

    ``named``: the call's header at once, then each text piece as its ``arguments``. ``required``: the output held
    and sent as whole calls at its end. ``auto``: text is sent as content until it may be a call (a ``<tool_call>``
    tag, or an output that starts as JSON); from there it is held, and at the end sent as calls if it parses as
    such, else as content. ``none``: content as it comes.

    Each method returns ``(content, tool_calls)`` to send (either may be empty); :attr:`called` says whether calls
    were sent (the finish reason is then ``tool_calls``).
    """

    tools: ToolPlan
    sent: str = ""
    held: str = ""
    holding: bool = False
    called: bool = False

    def feed(self, piece: str) -> tuple[str, list[DeltaToolCall]]:
        mode = self.tools.mode
        if mode == "none" or not piece:
            return piece, []
        if mode == "named":  # one entry per index in a delta (vLLM's, OpenAI's): the header with the first piece
            if not self.called:
                self.called = True
                return "", [DeltaToolCall(index=0, id=call_id(), type="function",
                                          function=DeltaFunction(name=self.tools.named, arguments=piece))]
            return "", [DeltaToolCall(index=0, function=DeltaFunction(arguments=piece))]
        self.held += piece
        if mode == "required" or self.holding:
            return "", []
        if not self.sent and self.held.lstrip()[:1] in ("{", "["):
            self.holding = True
            return "", []
        if not self.sent and not self.held.strip():
            return "", []  # leading blanks: the output may still start as JSON
        at = self.held.find(OPEN)
        if at >= 0:
            out, self.held, self.holding = self.held[:at], self.held[at:], True
        else:
            keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                         if OPEN.startswith(self.held[-k:])), 0)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent += out
        return out, []

    def end(self) -> tuple[str, list[DeltaToolCall]]:
        """What is still held, at the end of the output."""
        if self.tools.mode in ("none", "named") or not self.held:
            return "", []
        content, calls = parse(self.held, self.tools)
        self.held = ""
        if not calls:
            return content or "", []
        self.called = True
        return content or "", delta_calls(calls)
