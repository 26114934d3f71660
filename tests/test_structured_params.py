"""The spellings of an output constraint (OpenAI's response_format, vLLM's structured_outputs and
guided_* fields) read as one constraint; what cannot compile, or asks for two, is an InvalidParam
naming the field; schemas read as OpenAI's strict mode."""

from __future__ import annotations

import json

import pytest

from pdserve.common.errors import InvalidParam
from pdserve.common.sampling import SamplingParams
from pdserve.common.structured import Constraint, from_request, strict

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
STRICT = json.dumps({**SCHEMA, "additionalProperties": False})


@pytest.mark.parametrize(
    "kwargs, kind, spec",
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
            "json",
            STRICT,
        ),
        ({"structured_outputs": {"json": SCHEMA}}, "json", STRICT),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", STRICT),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", '["x", "y"]'),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", ""),
        ({"guided": {"guided_json": SCHEMA}}, "json", STRICT),
        ({"guided": {"guided_regex": "[0-9]"}}, "regex", "[0-9]"),
        ({"guided": {"guided_choice": ["a"]}}, "choice", '["a"]'),
        ({"guided": {"guided_grammar": 'start: "a"'}}, "grammar", 'start: "a"'),
    ],
)
def test_spellings(kwargs, kind, spec):
    c = from_request(**kwargs)
    assert c is not None and (c.kind, c.spec) == (kind, spec)
    assert Constraint.from_wire(c.to_wire()).to_wire() == c.to_wire()


def test_no_constraint():
    assert from_request() is None
    assert from_request({"type": "text"}, {}, {"guided_json": None}) is None


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{nope"}}}, "response_format"),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
        (
            {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}}},
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
        ({"guided": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"guided": {"guided_choice": "yes"}}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided": {"guided_regex": "a"}}, "guided_regex"),
        ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs"),
    ],
)
def test_refused_with_the_field_named(kwargs, param):
    with pytest.raises(InvalidParam) as e:
        from_request(**kwargs)
    assert e.value.param == param


def test_params_validate_the_constraint_they_carry():
    SamplingParams(structured={"kind": "regex", "spec": "[a-z]"}).validate(100)
    with pytest.raises(InvalidParam):
        SamplingParams(structured={"kind": "regex", "spec": "[a-z"}).validate(100)
    with pytest.raises(InvalidParam):
        SamplingParams(structured={"kind": "python", "spec": "x"}).validate(100)


def test_strict_closes_objects_that_list_their_properties():
    s = strict(
        {
            "type": "object",
            "properties": {
                "properties": {"type": "object", "properties": {"x": {"type": "string"}}},
                "free": {"type": "object"},
                "list": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
            },
            "$defs": {"d": {"type": "object", "properties": {"z": {}}, "additionalProperties": True}},
            "anyOf": [{"type": "object", "properties": {"w": {}}}],
        }
    )
    assert s["additionalProperties"] is False
    assert s["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["free"]  # no properties listed: any object
    assert s["properties"]["list"]["items"]["additionalProperties"] is False
    assert s["$defs"]["d"]["additionalProperties"] is True  # said explicitly: kept
    assert s["anyOf"][0]["additionalProperties"] is False
