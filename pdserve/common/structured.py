"""Structured outputs: what a request constrains its output to, read from the API's spellings, and
the grammar the token masks are computed from (llguidance; torch-free, so the router refuses a
grammar that cannot compile without touching a worker).

The spellings, one meaning: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older `guided_*`
fields. A request names at most one constraint. The constraint travels to the engines as
`SamplingParams.structured`, a plain {"kind", "spec"} dict (typed messages, never pickles).

JSON is compact by default: separators ", " and ": " and no other whitespace. A grammar that allows
any whitespace lets a sampled model wander in newlines and spaces until max_tokens, a known failure
of schema-constrained decoding; `whitespace_pattern` (vLLM's) opens it per request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pdserve.common.errors import InvalidParam

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# A constraint's text is compiled on the router and on each worker: its size is bounded (the
# compiler's own limits bound the work per byte).
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
_COMPACT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    spec: str  # JSON schema text, regex, JSON list of choices, Lark or GBNF grammar ("" for json_object)
    whitespace_pattern: str | None = None  # JSON only: the whitespace allowed between tokens
    param: str = "structured_outputs"  # the request field it came from, for errors

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "spec": self.spec}
        if self.whitespace_pattern is not None:
            d["whitespace_pattern"] = self.whitespace_pattern
        return d

    @staticmethod
    def from_wire(d: dict[str, Any], param: str = "structured_outputs") -> Constraint:
        if not isinstance(d, dict) or d.get("kind") not in KINDS or not isinstance(d.get("spec"), str):
            raise InvalidParam(f"structured: a {{kind, spec}} object with kind one of {KINDS}", param)
        ws = d.get("whitespace_pattern")
        if ws is not None and not isinstance(ws, str):
            raise InvalidParam("whitespace_pattern must be a string", param)
        return Constraint(d["kind"], d["spec"], ws, param)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def strict(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object lists its properties and says
    nothing of others, as OpenAI's strict structured outputs read a schema: the JSON Schema default
    (any extra key, of any length) lets a sampled model add keys without end."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: strict(v) for name, v in out[k].items()}
    for k in _SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = strict(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [strict(v) for v in out[k]]
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidParam(f"{param}: the schema is not JSON: {e}", param) from e
    if not isinstance(schema, (dict, bool)):
        raise InvalidParam(f"{param}: a JSON schema is an object", param)
    return json.dumps(strict(schema))


def _from_response_format(rf: Any) -> Constraint | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidParam("response_format must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", None, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidParam(
                "response_format json_schema needs its 'json_schema' object", "response_format"
            )
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            # OpenAI allows a json_schema without a schema: any JSON object.
            return Constraint("json_object", "", None, "response_format")
        return Constraint("json", _schema_text(schema, "response_format"), None, "response_format")
    raise InvalidParam(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema are)",
        "response_format",
    )


def _from_fields(fields: dict[str, Any], param: str, ws: str | None) -> Constraint | None:
    """vLLM's constraint keys (json, regex, choice, grammar, json_object), at most one set."""
    set_ = [
        k for k in ("json", "regex", "choice", "grammar", "json_object") if fields.get(k) not in (None, False)
    ]
    if not set_:
        return None
    if len(set_) > 1:
        raise InvalidParam(
            f"{param}: set one of json, regex, choice, grammar, json_object (got {set_})", param
        )
    key = set_[0]
    value = fields[key]
    if key == "json":
        return Constraint("json", _schema_text(value, param), ws, param)
    if key == "json_object":
        return Constraint("json_object", "", ws, param)
    if key == "choice":
        if (
            not isinstance(value, list)
            or not value
            or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidParam(f"{param}: choice is a list of 1 to {MAX_CHOICES} non-empty strings", param)
        return Constraint("choice", json.dumps(value), None, param)
    if not isinstance(value, str) or not value:
        raise InvalidParam(f"{param}: {key} must be a non-empty string", param)
    return Constraint(key, value, None, param)


def from_request(
    response_format: Any = None,
    structured_outputs: Any = None,
    guided: dict[str, Any] | None = None,
) -> Constraint | None:
    """The one constraint a request asks for (None: free text); InvalidParam names the field at fault."""
    found: list[Constraint] = []
    c = _from_response_format(response_format)
    if c is not None:
        found.append(c)
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise InvalidParam("structured_outputs must be an object", "structured_outputs")
        ws = structured_outputs.get("whitespace_pattern")
        if structured_outputs.get("structural_tag") is not None:
            raise InvalidParam("structured_outputs.structural_tag is not supported", "structured_outputs")
        c = _from_fields(structured_outputs, "structured_outputs", ws)
        if c is not None:
            found.append(c)
    legacy = {
        k.removeprefix("guided_"): v
        for k, v in (guided or {}).items()
        if k.startswith("guided_") and k != "guided_whitespace_pattern"
    }
    named = [k for k, v in legacy.items() if v not in (None, False)]
    ws = (guided or {}).get("guided_whitespace_pattern")
    c = _from_fields(legacy, "guided_" + (named[0] if named else "json"), ws)
    if c is not None:
        found.append(c)
    if len(found) > 1:
        raise InvalidParam(
            f"one output constraint per request; got {', '.join(x.param for x in found)}", found[1].param
        )
    if not found:
        return None
    c = found[0]
    if len(c.spec) > MAX_SPEC_CHARS:
        raise InvalidParam(f"{c.param}: at most {MAX_SPEC_CHARS} characters of schema or grammar", c.param)
    check(c)
    return c


def grammar(c: Constraint) -> str:
    """The llguidance grammar of a constraint (what LLMatcher compiles)."""
    import llguidance as ll

    if c.kind in ("json", "json_object"):
        opts: Any = dict(_COMPACT)
        if c.whitespace_pattern is not None:
            opts = {"whitespace_pattern": c.whitespace_pattern}
        schema = c.spec if c.kind == "json" else '{"type": "object"}'
        return ll.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
    if c.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        return ll.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(x) for x in json.loads(c.spec))
        )
    # grammar: Lark (llguidance's own) or GBNF/EBNF as llama.cpp and xgrammar write it.
    return ll.grammar_from("grammar", c.spec)


@lru_cache(maxsize=256)
def _error(c: Constraint) -> str:
    import llguidance as ll

    try:
        g = grammar(c)
    except ValueError as e:
        return str(e)
    return ll.LLMatcher.validate_grammar(g)


def check(c: Constraint) -> None:
    """InvalidParam (a 400 naming the field) for a constraint the grammar engine cannot compile."""
    err = _error(c)
    if err:
        raise InvalidParam(f"{c.param}: cannot compile the {c.kind} constraint: {err.strip()[:500]}", c.param)
