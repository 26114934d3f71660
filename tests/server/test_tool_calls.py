"""A chat request's tools: tool_choice into a constraint or a parser, the tools and earlier calls into
the chat template (native templates get them as variables, others as text), answers read back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.common.errors import InvalidParam
from pdserve.common.tokenizer import default_gguf_path, load_gguf_tokenizer
from pdserve.protocol import ChatCompletionRequest
from pdserve.server import tool_calls

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "time"}},
]
NATIVE = "{% for t in tools %}{{ t.function.name }}{% endfor %}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_no_tools_or_none_is_plain_chat():
    assert tool_calls.plan(_req(), None, NATIVE) is None
    assert tool_calls.plan(_req(tools=TOOLS, tool_choice="none"), None, NATIVE) is None


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_refusals_name_the_field(kw, param):
    with pytest.raises(InvalidParam) as e:
        tool_calls.plan(_req(**kw), None, NATIVE)
    assert e.value.param == param


def test_auto_needs_a_known_format_on_a_native_template():
    with pytest.raises(InvalidParam):
        tool_calls.plan(_req(tools=TOOLS), None, NATIVE)  # the template says no format
    assert tool_calls.plan(_req(tools=TOOLS), "mistral", NATIVE).parser == "mistral"
    assert tool_calls.plan(_req(tools=TOOLS), None, NATIVE + "<tool_call>").parser == "hermes"


def test_required_constrains_to_calls_of_the_tools():
    p = tool_calls.plan(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None, NATIVE)
    schema = json.loads(p.constraint.spec)
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate([{"name": "time", "parameters": {}}] * 2, schema)
    content, calls = tool_calls.message(p, '[{"name": "weather", "parameters": {"city": "Oslo"}}]')
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("weather", '{"city": "Oslo"}')
    ]


def test_named_function_output_is_its_arguments_streamed_or_not():
    p = tool_calls.plan(
        _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}), None, NATIVE
    )
    jsonschema.validate({"city": "x"}, json.loads(p.constraint.spec))
    text = '{"city": "Rome"}'
    content, [call] = tool_calls.message(p, text)
    assert content is None and call["function"] == {"name": "weather", "arguments": text}
    r = p.reader()
    deltas = [d for piece in ('{"ci', 'ty": "Ro', 'me"}') for d in r.feed(piece)[1]] + r.finish()[1]
    assert deltas[0].id and deltas[0].name == "weather" and all(d.id is None for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == text


def test_a_template_without_tools_gets_them_described_and_calls_as_text():
    tok = load_gguf_tokenizer(str(default_gguf_path()))  # SmolLM2's ChatML template renders no tools
    p = tool_calls.plan(_req(tools=TOOLS), None, tok.chat_template)
    assert p.described and p.parser == "hermes" and p.template_kwargs() == {}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(tool_calls.template_messages(history, p, tok.chat_template))
    assert '"name": "weather"' in text.split("<tools>")[1]  # the tools, in the system message
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "sunny" in text


def test_a_native_template_gets_tools_and_calls_with_object_arguments():
    p = tool_calls.plan(_req(tools=TOOLS), "hermes", NATIVE)
    assert not p.described and p.template_kwargs() == {"tools": TOOLS}
    call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    [m] = tool_calls.template_messages(
        [{"role": "assistant", "content": "", "tool_calls": [call]}], p, NATIVE
    )
    assert m["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
