"""docs/configuration.md is generated from the config's dataclasses; regenerating it must give the
committed file, so a key added, renamed or re-defaulted in config.py cannot leave the reference behind."""

import dataclasses
from pathlib import Path

from pdserve.config import Config, RoleConfig
from pdserve.config_doc import generate

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _keys(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, RoleConfig):
            continue
        if dataclasses.is_dataclass(value):
            yield from _keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_the_committed_reference_is_what_the_generator_writes():
    assert DOC.read_text() == generate(), (
        "docs/configuration.md is stale: run `python -m pdserve.config_doc > docs/configuration.md`"
    )


def test_every_key_has_a_row_with_its_default():
    text = generate()
    cfg = Config()
    for key in _keys(cfg):
        assert f"| `{key}` |" in text, key
    for f in dataclasses.fields(RoleConfig):
        assert f"| `deployment.<role>.{f.name}` |" in text, f.name
    assert "| `cache.block_size` | `int` | `16` | `--block-size` |" in text
    assert "| `router.migration` | `bool` | `true` |" in text
