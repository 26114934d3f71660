"""Reading config values as written: YAML files and dotted overrides into (key, value, name written)
leaves, other names of keys (aliases) resolved, then set on a fresh Config. Checking the values is
config_rules.py's job; the defaults live in config.py alone."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pdserve.config_rules import ConfigError

if TYPE_CHECKING:
    from pdserve.config import Config

# Other names of keys, as examples/wide-ep.yaml writes them; an alias sets every
# key it names, so the loaded Config has one place for each value.
ALIASES = {
    "deployment.cache.prefix_cache": ("cache.prefix_cache",),
    "deployment.cache.transfer_bandwidth_limit": ("transfer.bandwidth_limit",),
    "cache.transfer_bandwidth_limit": ("transfer.bandwidth_limit",),
    "deployment.load_balancer.strategy": ("load_balancer.prefill", "load_balancer.decode"),
    "load_balancer.strategy": ("load_balancer.prefill", "load_balancer.decode"),
}
_ALIAS_PARENTS = {a.rsplit(".", 1)[0] for a in ALIASES}


def leaves_of(obj: Any, data: dict, prefix: str, out: list, problems: list) -> None:
    """(key, value, key as written) for every value in the nested mapping `data`, aliases resolved."""
    known = {f.name for f in fields(obj)} if obj is not None else set()
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in ALIASES:
            out.extend((target, value, path) for target in ALIASES[path])
        elif key in known and dataclasses.is_dataclass(getattr(obj, key)):
            if isinstance(value, dict):
                leaves_of(getattr(obj, key), value, path + ".", out, problems)
            else:
                problems.append((path, f"must be a mapping of keys, not {value!r}"))
        elif key in known:
            out.append((path, value, path))
        elif path in _ALIAS_PARENTS and isinstance(value, dict):
            leaves_of(None, value, path + ".", out, problems)
        else:
            here = known | {a[len(prefix) :].split(".")[0] for a in ALIASES if a.startswith(prefix)}
            problems.append((path, f"unknown key; known here: {', '.join(sorted(here))}"))


def set_leaves(cfg: Config, leaves: list, problems: list, written_as: dict[str, str]) -> set[str]:
    """Sets each leaf; two names of one key that disagree within one source are an error. `written_as`
    gets the name the user wrote for each key set through an alias, to name it in errors."""
    seen: dict[str, tuple[Any, str]] = {}
    for key, value, written in leaves:
        if key in seen and seen[key][0] != value:
            problems.append(
                (written, f"{value!r} conflicts with {seen[key][1]}: {seen[key][0]!r} (set one of them)")
            )
            continue
        seen[key] = (value, written)
        if written != key:
            written_as[key] = written
        else:
            written_as.pop(key, None)
        *parents, leaf = key.split(".")
        obj = cfg
        for p in parents:
            obj = getattr(obj, p)
        object.__setattr__(obj, leaf, value)  # building a fresh Config: frozen once load_config returns
    return set(seen)


def read_yaml(path: str | Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError([(str(path), f"cannot read the config file: {e}")]) from None
    if not isinstance(data, dict):
        raise ConfigError([(str(path), "the top level must be a mapping of sections (model:, cache:, ...)")])
    return data


def nest_dotted(overrides: dict[str, Any], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Dotted keys ("cache.block_size": 32) into a nested mapping (`into` or a new one); None (a flag not given) skipped."""
    nested: dict[str, Any] = {} if into is None else into
    for dotted, value in overrides.items():
        if value is None:
            continue
        *parents, leaf = dotted.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested
