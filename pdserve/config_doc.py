"""The configuration reference (docs/configuration.md), generated from the config's dataclasses so it
cannot drift from them: every key with its type and default (config.py), its flag (config_flags.py),
its allowed values or range (config_rules.py), other names it may be written as (config_yaml.py), and
the comments beside and above its field in config.py, which are its documentation.

    python -m pdserve.config_doc > docs/configuration.md

tests/test_config_doc.py regenerates it and compares it with the committed file.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
from pathlib import Path
from typing import Any

from pdserve import config as config_module
from pdserve.config import ROLE_SETTINGS, Config, RoleConfig
from pdserve.config_flags import FLAGS
from pdserve.config_rules import BOUNDS, CHOICES
from pdserve.config_yaml import ALIASES

INTRO = """\
# Configuration reference

This file is generated from `pdserve/config.py` by `python -m pdserve.config_doc > docs/configuration.md`
(`tests/test_config_doc.py` keeps it in step); edit the comments in `config.py`, not this file.

`pdserve serve --config file.yaml` (see `examples/pd.yaml`, `examples/mixed.yaml`, `examples/wide-ep.yaml`)
reads the sections below as nested YAML keys; flags override the file; the defaults live in one place,
`pdserve/config.py`. Every value is checked when the config loads, the file's and the flags' alike
(`pdserve/config_rules.py`): unknown keys, types, the allowed values and ranges listed here (every number
without a rule of its own is `>= 0`) and formats (ratios, bandwidths, CIDRs, URLs, endpoints). A bad one
stops `pdserve` with exit status 2 before anything starts, one line per problem naming the key, the value
and what is allowed. `pdserve serve --dry-run` checks the config against the model too and prints the
plan ([deploying.md](deploying.md)). The offline `LLM(...)` takes the flags' names as keywords, and any
other key with its dots written as `__` (`LLM(model="smollm2-135m", cache__block_size=32)`).

In a PD deployment `deployment.prefill` and `deployment.decode` may each set the keys of
`deployment.<role>` below; each replaces the global key it names for that role's workers, and unset
ones inherit it. A `pdserve worker --role R` process applies `deployment.R` from its config file, and
its own flags win over it.
"""


def _comments(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment lines just above the field and the comment at its line's end."""
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][: tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above: list[str] = []
            n = item.lineno - 2
            while n >= 0 and lines[n].strip().startswith("#"):
                above.insert(0, lines[n].strip().lstrip("#").strip())
                n -= 1
            end = item.end_lineno or item.lineno  # a comment anywhere in a statement the formatter split
            parts = [*above, *(trailing.get(n, "") for n in range(item.lineno, end + 1))]
            out[(node.name, item.target.id)] = " ".join(p for p in parts if p)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _flags() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, f in FLAGS.items():
        dashed = name.replace("_", "-")
        if not f.cli:
            out[f.key] = f"`LLM({name}=)` only"
        elif f.negative:
            out[f.key] = f"`--no-{dashed}`"
        else:
            out[f.key] = f"`--{dashed}`"
    return out


def _rows(cls: type, prefix: str, comments: dict, flags: dict[str, str]) -> list[str]:
    rows = []
    for f in dataclasses.fields(cls):
        default = _default(f)
        if isinstance(default, RoleConfig):
            continue
        key = f"{prefix}.{f.name}"
        rule_key = key.replace("<role>", "prefill")
        notes = [comments.get((cls.__name__, f.name), "")]
        if rule_key in CHOICES:
            notes.append("Allowed: " + ", ".join(f"`{c}`" for c in CHOICES[rule_key]) + ".")
        if rule_key in BOUNDS:
            notes.append(f"Range: {BOUNDS[rule_key]}.")
        if prefix == "deployment.<role>" and f.name in ROLE_SETTINGS:
            notes.append(f"Replaces `{ROLE_SETTINGS[f.name]}` for the role's workers.")
        names = [a for a, targets in ALIASES.items() if key in targets]
        if names:
            notes.append("Also written as " + ", ".join(f"`{a}`" for a in names) + ".")
        meaning = " ".join(n if n.endswith(".") else n + "." for n in notes if n)
        rows.append(
            f"| `{key}` | `{_cell(str(f.type))}` | {_shown(default)} | {flags.get(key, '')} | {_cell(meaning)} |"
        )
    return rows


def generate() -> str:
    comments = _comments(Path(config_module.__file__).read_text())
    flags = _flags()
    out = [INTRO]
    for section in dataclasses.fields(Config):
        cls = type(_default(section))
        doc = (cls.__doc__ or "").strip()
        out.append(f"## `{section.name}`\n")
        if doc and not doc.startswith(
            cls.__name__ + "("
        ):  # dataclasses invent a docstring when none is written
            out.append(doc + "\n")
        out.append("| key | type | default | flag | meaning |")
        out.append("|---|---|---|---|---|")
        out.extend(_rows(cls, section.name, comments, flags))
        if cls is type(Config().deployment):
            out.append("")
            out.append("### `deployment.<role>` (`deployment.prefill`, `deployment.decode`)\n")
            out.append("| key | type | default | flag | meaning |")
            out.append("|---|---|---|---|---|")
            out.extend(_rows(RoleConfig, "deployment.<role>", comments, flags))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(generate(), end="")
