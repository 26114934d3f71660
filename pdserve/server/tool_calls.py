"""Tool calls of a chat request: the tools into the chat template, tool_choice into an output
constraint, and the answer's text back into OpenAI's `tool_calls` (streamed as deltas too).

- `none`: the tools are not shown to the model; the answer is text.
- `auto` (the default with tools): the model decides; its calls are read back by the tool-call
  parser of its format (server.tool_call_parser, else the one its chat template implies).
- `required`: the output is constrained to a JSON array of {"name", "parameters"} objects, one of
  the request's tools each (one only with parallel_tool_calls false), so every call parses and
  matches its tool's schema.
- a named function: the output is constrained to that function's arguments object.

A chat template that renders no tools (SmolLM2's, plain ChatML) still gets them: a system message
describes them and asks for hermes' <tool_call> form, and an assistant's earlier calls are written
into its message in that same form, so a conversation round-trips through any template.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.errors import InvalidParam
from pdserve.common.structured import Constraint, check, strict
from pdserve.common.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolParser,
    make_call_id,
    parse,
    parser_for_template,
)
from pdserve.protocol import ChatCompletionRequest

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _template_renders(template: str | None, word: str) -> bool:
    return bool(template) and word in template  # type: ignore[operator]


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # the request's tools, as {"type": "function", "function": {...}}
    choice: str  # auto | required | named
    name: str | None = None  # choice "named": the function
    parser: str = "hermes"  # choice "auto": how calls are read back
    constraint: Constraint | None = None  # required and named choices
    described: bool = False  # the template renders no tools: a system message describes them
    names: list[str] = field(default_factory=list)

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.described else {"tools": self.tools}

    def reader(self) -> ToolReader:
        return ToolReader(self)


def _params_schema(fn: dict[str, Any]) -> dict[str, Any]:
    return strict(fn.get("parameters") or _ANY_OBJECT)


def plan(req: ChatCompletionRequest, configured_parser: str | None, template: str | None) -> ToolPlan | None:
    """None: the request has no tools, or tool_choice none (a plain chat answer)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise InvalidParam("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParam("tools: each function name may appear once", "tools")
    described = not _template_renders(template, "tools")
    p = ToolPlan(tools, "auto", names=names, described=described)
    if choice is None or choice == "auto":
        parser = configured_parser or ("hermes" if described else parser_for_template(template))
        if parser is None:
            raise InvalidParam(
                "tool_choice auto: this model's tool-call format is not known; start the server with "
                "--tool-call-parser, or use tool_choice required or a named function",
                "tool_choice",
            )
        p.parser = parser
        return p
    if choice == "required":
        call = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": _params_schema(t["function"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        p.choice, p.parser = "required", "json"
        p.constraint = Constraint("json", json.dumps(schema), None, "tool_choice")
    else:
        name = choice.function.get("name") if isinstance(choice.function, dict) else None
        if name not in names:
            raise InvalidParam(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        fn = tools[names.index(name)]["function"]
        p.choice, p.name = "named", name
        p.constraint = Constraint("json", json.dumps(_params_schema(fn)), None, "tools")
    try:
        check(p.constraint)
    except InvalidParam as e:
        raise InvalidParam(f"a tool's parameters schema cannot compile: {e}", "tools") from e
    return p


def shown(tools: list[Any] | None, template: str | None) -> ToolPlan | None:
    """The tools as a prompt shows them, with no answer to read back (/tokenize)."""
    if not tools:
        return None
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    return ToolPlan(dumped, "auto", described=not _template_renders(template, "tools"))


def describe_tools(tools: list[dict[str, Any]]) -> str:
    """The system text that shows a template without tool support the tools, in hermes' form."""
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer. The functions, as JSON schemas:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, write for each call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
    )


def _call_text(calls: list[dict[str, Any]]) -> str:
    return "".join(
        "<tool_call>\n"
        + json.dumps(
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
        )
        + "\n</tool_call>"
        for c in calls
    )


def template_messages(messages: list[dict[str, Any]], p: ToolPlan | None, template: str | None) -> list[dict]:
    """The chat messages as the template takes them: an assistant's tool_calls with their arguments
    as objects (templates iterate them); a template that knows no tool calls gets them as text."""
    knows_calls = _template_renders(template, "tool_calls")
    out = []
    for m in messages:
        m = copy.deepcopy(m)
        calls = m.get("tool_calls")
        if calls:
            for c in calls:
                try:
                    c["function"]["arguments"] = json.loads(c["function"]["arguments"])
                except (ValueError, TypeError):
                    pass  # kept as written: the template shows the string
            if not knows_calls:
                m["content"] = (m.get("content") or "") + _call_text(calls)
                del m["tool_calls"]
        out.append(m)
    if p is not None and p.described:
        text = describe_tools(p.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


class ToolReader:
    """One choice's answer read back into content and tool calls, whole or delta by delta (the same
    state machine both ways, so the streamed pieces add up to the whole message)."""

    def __init__(self, p: ToolPlan) -> None:
        self.plan = p
        self.named_id: str | None = None
        self.named_args = ""
        self.parser = None if p.choice == "named" else ToolParser(p.parser, p.names)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.parser is not None:
            return self.parser.feed(text)
        if not text:
            return "", []
        self.named_args += text
        if self.named_id is None:
            self.named_id = make_call_id()
            return "", [ToolCallDelta(0, self.named_id, self.plan.name, text)]
        return "", [ToolCallDelta(0, None, None, text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.parser is not None:
            return self.parser.finish()
        if self.named_id is None:  # an empty answer still names its call
            self.named_id = make_call_id()
            return "", [ToolCallDelta(0, self.named_id, self.plan.name, "")]
        return "", []

    @property
    def calls(self) -> list[ToolCall]:
        if self.parser is not None:
            return self.parser.calls
        assert self.named_id is not None and self.plan.name is not None
        return [ToolCall(self.named_id, self.plan.name, self.named_args)]


def message(p: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content and OpenAI tool_calls."""
    if p.choice == "named":
        r = ToolReader(p)
        r.feed(text)
        r.finish()
        return None, [_openai(c) for c in r.calls]
    content, calls = parse(p.parser, text, p.names)
    return content, [_openai(c) for c in calls]


def _openai(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
