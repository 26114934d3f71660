"""The tool-call parsers (common/tool_parsers): each format's calls read out of a realistic answer
with the text around them kept as content; text that only looks like a call (bad JSON, a tool the
request did not offer) kept as content too; and, for every parser, that any way of cutting the
output into stream deltas (one character at a time, random cuts, all at once) gives back the
non-streamed message: the content pieces add up to its content, each call's argument pieces to its
arguments, and the first delta of a call carries the id and name the message lists."""

from __future__ import annotations

import json
import random
import re

import pytest

from pdserve.common.tool_parsers import (
    PARSERS,
    ToolCallDelta,
    ToolParser,
    make_call_id,
    parse,
    parser_for_template,
)

# DeepSeek's tool tokens, spelled from their code points (full-width bar U+FF5C, U+2581 for a space).
_B, _S = "\uff5c", "\u2581"
DS_CALLS_BEGIN, DS_CALLS_END = f"<{_B}tool{_S}calls{_S}begin{_B}>", f"<{_B}tool{_S}calls{_S}end{_B}>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    f"<{_B}tool{_S}call{_S}begin{_B}>",
    f"<{_B}tool{_S}call{_S}end{_B}>",
    f"<{_B}tool{_S}sep{_B}>",
)

PARIS = {"city": "Paris", "unit": "celsius"}
ZURICH = {"city": "Zürich", "note": '東京 ☂ "quoted"', "days": 3}


def _hermes(obj: dict) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


# kind -> (output, content, [(name, arguments dict)])
SAMPLES = {
    "hermes": (
        "I'll look both up.\n"
        + _hermes({"name": "get_weather", "arguments": PARIS})
        + "\n"
        + _hermes({"name": "get_weather", "arguments": ZURICH})
        + "\nOne moment.",
        "I'll look both up.\n\n\nOne moment.",
        [("get_weather", PARIS), ("get_weather", ZURICH)],
    ),
    "qwen3": (
        _hermes({"name": "get_weather", "arguments": PARIS})
        + "\n"
        + _hermes({"name": "get_time", "arguments": {}}),
        None,
        [("get_weather", PARIS), ("get_time", {})],
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + json.dumps(PARIS)
        + '}; {"name": "get_weather", "parameters": '
        + json.dumps(ZURICH, ensure_ascii=False)
        + "}",
        None,
        [("get_weather", PARIS), ("get_weather", ZURICH)],
    ),
    "mistral": (
        "Let me check.[TOOL_CALLS]get_weather[ARGS]"
        + json.dumps(PARIS)
        + "[TOOL_CALLS]get_weather[ARGS]"
        + json.dumps(ZURICH, ensure_ascii=False),
        "Let me check.",
        [("get_weather", PARIS), ("get_weather", ZURICH)],
    ),
    "qwen3_coder": (
        "Checking the weather first.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
        '<parameter=content>\ndef f():\n    return "Zürich"\n</parameter>\n<parameter=mode>\n420\n</parameter>\n'
        '<parameter=flags>\n["x", true]\n</parameter>\n</function>\n</tool_call>\nDone.',
        "Checking the weather first.\n\n\n\nDone.",
        [
            ("get_weather", PARIS),
            (
                "write_file",
                {
                    "path": "/tmp/a.py",
                    "content": 'def f():\n    return "Zürich"',
                    "mode": 420,
                    "flags": ["x", True],
                },
            ),
        ],
    ),
    "deepseek_v3": (
        f"Let me check both.\n{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
        + json.dumps(PARIS)
        + f"\n```{DS_CALL_END}\n{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
        + json.dumps(ZURICH, ensure_ascii=False)
        + f"\n```{DS_CALL_END}{DS_CALLS_END}\nBack soon.",
        "Let me check both.\n\nBack soon.",
        [("get_weather", PARIS), ("get_weather", ZURICH)],
    ),
    "deepseek_v31": (
        f"Sure.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}"
        + json.dumps(PARIS)
        + f"{DS_CALL_END}{DS_CALL_BEGIN}get_time{DS_SEP}{{}}{DS_CALL_END}{DS_CALLS_END}",
        "Sure.",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    "json": (
        json.dumps(
            [{"name": "get_weather", "parameters": PARIS}, {"name": "get_weather", "parameters": ZURICH}],
            ensure_ascii=False,
        ),
        None,
        [("get_weather", PARIS), ("get_weather", ZURICH)],
    ),
}
SAMPLES["hermes_qwen"] = SAMPLES["hermes"]
SAMPLES["mistral_array"] = (
    'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": '
    + json.dumps(PARIS)
    + '}, {"name": "get_time", "arguments": {}, "id": "a1b2c3d4e"}]',
    "Sure. ",
    [("get_weather", PARIS), ("get_time", {})],
)
SAMPLES["mistral_call_id"] = (
    "[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]" + json.dumps(ZURICH, ensure_ascii=False),
    None,
    [("get_weather", ZURICH)],
)
SAMPLES["deepseek_v3_bare_call"] = (
    f"{DS_CALL_BEGIN}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}",
    None,
    [("get_time", {})],
)
KIND = {
    "hermes_qwen": "qwen",
    "mistral_array": "mistral",
    "mistral_call_id": "mistral",
    "deepseek_v3_bare_call": "deepseek_v3",
}
TOOLS = ("get_weather", "get_time", "write_file")

# kind -> outputs that look like calls but are not: all of their text stays content.
NOT_CALLS = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "rm_everything", "arguments": {}}\n</tool_call>',  # not an offered tool
        '<tool_call>\n{"name": "get_weather", "arguments": {"x": NaN}}\n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # not an object
        'a <tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        "1 < 2 and <tool_calls> are fine",
    ],
    "llama3_json": [
        "The weather in Paris is mild.",
        '{"answer": 42}',  # an answer that is JSON
        '{"name": "Bob", "age": 3}',  # no parameters: not a call
        '<|python_tag|>brave_search.call(query="Paris")',  # a built-in tool call, not JSON
        '{"name": "get_weather", "parameters": {"city": "Par',
        '  Sure: {"name": "get_weather", "parameters": {}}',
    ],
    "mistral": [
        "[TOOL_CALLS] I cannot call tools here.",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        "[TOOL_CALLS]get_weather[ARGS]",
    ],
    "qwen3_coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no </function>
        "<tool_call>\n<function=launch_missiles>\n</function>\n</tool_call>",
        "<tool_call>\nsome prose\n<function=get_weather>\n</function>\n</tool_call>",
    ],
    "deepseek_v3": [
        f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n{{bad}}\n```{DS_CALL_END}{DS_CALLS_END}",
        f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}nope{DS_SEP}{{}}{DS_CALL_END}{DS_CALLS_END}",
        f"{DS_CALLS_BEGIN}just text",
        f"{DS_CALL_BEGIN}get_weather{{}}{DS_CALL_END}",  # no separator
    ],
    "json": [
        "I don't need a tool for that.",
        "[]",
        '[{"name": "nope", "parameters": {}}]',
        "[1, 2]",
    ],
}


def _stream(kind, text, cuts, tool_names=TOOLS):
    p = ToolParser(kind, tool_names)
    content, deltas, prev = [], [], 0
    for at in [*cuts, len(text)]:
        c, d = p.feed(text[prev:at])
        content.append(c)
        deltas += d
        prev = at
    c, d = p.finish()
    return "".join(content + [c]), deltas + d, p


def _cuttings(text, seed=0):
    """Every cut into 1-character deltas, random cuttings with a fixed seed, and no cut at all."""
    rng = random.Random(seed)
    yield list(range(1, len(text)))
    for _ in range(40):
        k = rng.randint(1, max(1, len(text) // 3))
        yield sorted(rng.sample(range(1, len(text)), k=min(k, max(0, len(text) - 1))))
    yield []


def assert_streams_add_up(kind, text, tool_names=TOOLS, seed=0):
    content, calls = parse(kind, text, tool_names)
    for cuts in _cuttings(text, seed):
        got, deltas, p = _stream(kind, text, cuts, tool_names)
        assert got == (content or ""), (kind, text, cuts)
        assert [(c.name, c.arguments) for c in p.calls] == [(c.name, c.arguments) for c in calls]
        pieces: dict[int, list[ToolCallDelta]] = {}
        for d in deltas:
            pieces.setdefault(d.index, []).append(d)
        assert sorted(pieces) == list(range(len(p.calls)))
        for i, call in enumerate(p.calls):
            first, *rest = pieces[i]
            assert (first.id, first.name) == (call.id, call.name)
            assert all(d.id is None and d.name is None for d in rest)
            assert "".join(d.arguments for d in pieces[i]) == call.arguments
    return content, calls


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_a_realistic_answer_per_format(sample):
    text, want_content, want_calls = SAMPLES[sample]
    kind = KIND.get(sample, sample)
    content, calls = assert_streams_add_up(kind, text)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    for call, (_, args) in zip(calls, want_calls):
        assert call.arguments == json.dumps(args, ensure_ascii=False)  # non-ASCII written as itself
        want_id = r"[A-Za-z0-9]{9}" if kind == "mistral" else r"call_[A-Za-z0-9]{24}"
        assert re.fullmatch(want_id, call.id)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("kind, text", [(k, t) for k, texts in NOT_CALLS.items() for t in texts])
def test_what_only_looks_like_a_call_stays_content(kind, text):
    content, calls = assert_streams_add_up(kind, text)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("kind", ["hermes", "qwen3_coder"])
def test_a_bad_call_beside_good_ones_loses_no_text(kind):
    good = SAMPLES[kind][0]
    bad = "<tool_call>\n{not a call}\n</tool_call>"
    content, calls = assert_streams_add_up(kind, f"{bad}\n{good}")
    assert content.startswith(bad + "\n")
    assert [c.name for c in calls] == [name for name, _ in SAMPLES[kind][2]]


def test_a_call_inside_an_unclosed_one_is_still_found():
    text = 'a <tool_call> oops <tool_call>{"name": "get_time", "arguments": {}}</tool_call> b'
    content, calls = assert_streams_add_up("hermes", text)
    assert content == "a <tool_call> oops  b"
    assert [c.name for c in calls] == ["get_time"]


def test_arguments_written_as_a_json_string_are_read():
    text = _hermes({"name": "get_time", "arguments": json.dumps({"tz": "Europe/Zürich"})})
    _, calls = assert_streams_add_up("hermes", text)
    assert calls[0].arguments == '{"tz": "Europe/Zürich"}'


def test_unknown_tools_are_content_and_any_name_passes_without_a_tool_list():
    text = SAMPLES["hermes"][0]
    content, calls = assert_streams_add_up("hermes", text, tool_names=["get_time"])
    assert (content, calls) == (text, [])
    content, calls = assert_streams_add_up("hermes", text, tool_names=None)
    assert len(calls) == 2


def test_a_marker_cut_across_deltas_is_held_until_whole():
    p = ToolParser("hermes", TOOLS)
    assert p.feed("Let me look <tool_") == ("Let me look ", [])
    assert p.feed('call>{"name": "get_time", "arguments": {}}</tool') == ("", [])
    content, deltas = p.feed("_call> ok")
    assert content == " ok"
    assert [(d.name, d.arguments) for d in deltas] == [("get_time", "{}")]
    # A held start that turns out not to be a marker comes back as content.
    p = ToolParser("deepseek_v3", TOOLS)
    assert p.feed("x " + DS_CALLS_BEGIN[:5]) == ("x ", [])
    assert p.feed("!") == (DS_CALLS_BEGIN[:5] + "!", [])
    p = ToolParser("mistral", TOOLS)
    assert p.feed("ok [TOOL_") == ("ok ", [])
    assert p.finish() == ("[TOOL_", [])


@pytest.mark.parametrize("kind, opening", [("hermes", "{"), ("qwen3_coder", "<function=")])
def test_a_tag_in_prose_does_not_hold_the_stream_until_the_end(kind, opening):
    p = ToolParser(kind, TOOLS)
    assert p.feed("Wrap calls in <tool_call>\n" + opening[:-1]) == ("Wrap calls in ", [])  # may be a call yet
    assert p.feed(" tags, then") == ("<tool_call>\n" + opening[:-1] + " tags, then", [])


def test_streams_of_random_pieces_add_up():
    """Outputs made of markers, pieces of markers and JSON fragments, cut at random."""
    rng = random.Random(1)
    call = '{"name": "get_time", "arguments": {"tz": "ü"}}'
    pieces = {
        "hermes": ["<tool_call>", "</tool_call>", "<tool", "_call>", call, "{", "}", " ", "\n", "hi"],
        "llama3_json": [
            '{"name": "get_time", "parameters": {}}',
            "<|python_tag|>",
            "<|py",
            ";",
            "{",
            "}",
            " ",
            "x",
        ],
        "mistral": [
            "[TOOL_CALLS]",
            "[TOOL_",
            "get_time",
            "[ARGS]",
            "[CALL_ID]",
            "{}",
            "[",
            call,
            "]",
            ",",
            " ",
        ],
        "qwen3_coder": [
            "<tool_call>",
            "</tool_call>",
            "<function=get_time>",
            "</function>",
            "<parameter=tz>",
            "\n",
        ]
        + ["</parameter>", "UTC", "1", "<tool"],
        "deepseek_v3": [DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, DS_CALL_BEGIN[:4]]
        + ["function", "get_time", "\n", "```json", "```", "{}", "x"],
        "json": ["[", "]", ",", " ", '{"name": "get_time", "parameters": {}}', "{", "}", "x"],
    }
    for kind, parts in pieces.items():
        for i in range(60):
            text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 10)))
            assert_streams_add_up(kind, text, seed=i)


def test_qwen3_coder_values_are_typed_as_best_it_can_without_a_schema():
    params = {
        "s": "Paris",
        "n": "-1.5",
        "b": "false",
        "z": "null",
        "o": '{"a": [1]}',
        "q": '"x"',
        "zip": "02134",
    }
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    _, calls = parse("qwen3_coder", f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>")
    assert json.loads(calls[0].arguments) == {
        "s": "Paris",
        "n": -1.5,
        "b": False,
        "z": None,
        "o": {"a": [1]},
        "q": '"x"',
        "zip": "02134",
    }


def test_json_cut_short_keeps_its_whole_calls():
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    content, calls = assert_streams_add_up("json", text)
    assert [c.name for c in calls] == ["get_time"]
    assert content == ', {"name": "get_weather", "parameters": {"ci'  # the separator too: no text is lost


def test_whitespace_only_content_is_none_with_calls_but_kept_without():
    assert parse("hermes", "\n\n")[0] == "\n\n"
    assert parse("hermes", "")[0] == ""
    assert parse("hermes", '\n<tool_call>{"name": "get_time"}</tool_call>\n')[0] is None


def test_delta_to_openai():
    first = ToolCallDelta(index=1, id="call_x", name="get_time", arguments="{}")
    assert first.to_openai() == {
        "index": 1,
        "id": "call_x",
        "type": "function",
        "function": {"name": "get_time", "arguments": "{}"},
    }
    assert ToolCallDelta(index=1, arguments='{"a"').to_openai() == {
        "index": 1,
        "function": {"arguments": '{"a"'},
    }
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", make_call_id())


def test_every_parser_has_a_sample_and_unknown_kinds_are_refused():
    assert {KIND.get(s, s) for s in SAMPLES} == set(PARSERS)
    with pytest.raises(ValueError, match="hermes"):
        ToolParser("mystery")


@pytest.mark.parametrize(
    "template, want",
    [
        # Qwen2.5 / Qwen3: hermes' form inside <tool_call> tags.
        (
            "{%- if tools %}For each function call, return a json object with function name and arguments "
            'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call>{%- endif %}',
            "hermes",
        ),
        # Qwen3-Coder: <function=...> blocks inside <tool_call>.
        (
            "reply in the following format:\n\n<tool_call>\n<function=example_function_name>\n"
            "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>",
            "qwen3_coder",
        ),
        # Llama 3.1: built-in tools behind <|python_tag|>.
        ("{{- '<|python_tag|>' + tool_call.name + '.call(' }}", "llama3_json"),
        # Llama 3.2: tool results in an ipython turn.
        ('{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}', "llama3_json"),
        ("{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}", "mistral"),
        (
            "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' "
            "+ tool['function']['name']}}",
            "deepseek_v3",
        ),
        ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", None),
        (None, None),
    ],
)
def test_parser_for_template(template, want):
    assert parser_for_template(template) == want


def test_deepseek_tokens_are_spelled_with_their_code_points():
    from pdserve.common.tool_parsers import deepseek

    assert deepseek.CALLS_BEGIN == DS_CALLS_BEGIN == "<｜tool▁calls▁begin｜>"
    assert [deepseek.CALLS_END, deepseek.CALL_BEGIN, deepseek.CALL_END, deepseek.SEP] == [
        DS_CALLS_END,
        DS_CALL_BEGIN,
        DS_CALL_END,
        DS_SEP,
    ]


def test_mistral_ids_are_the_nine_characters_its_templates_take_back():
    _, calls = parse("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]')
    assert len(calls) == 1 and len(calls[0].id) == 9 and calls[0].id.isalnum()
    _, calls = parse("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert calls[0].id.startswith("call_")
