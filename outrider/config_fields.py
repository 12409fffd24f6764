"""How any config section is checked and read, whoever defines it (the engine's in
outrider/config.py, the server's in outrider/server/config.py): each field's type against its
annotation with a message naming the field, a YAML file as a mapping with the place of a fault,
a section built from its keys, and the close matches of a key that is not one."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import types
import typing
from pathlib import Path
from typing import Any

# -- field types: checked first in every config's __post_init__ --------------------------------

# What a field of each kind takes, for the message: "invalid block_size='16k': use an integer".
_KIND_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    tuple: "a list of strings",
}


def check_types(config: Any) -> None:
    """Refuse a field of the dataclass `config` whose value is not of its annotated kind (int,
    float, bool, str, tuple[str, ...], each maybe `| None`), so YAML's `max_num_seqs: "lots"`
    or `block_size: true` is a ValueError naming the field and its value, not a TypeError from
    the range check after it. A float field takes an int, a str field a path (made its str), a
    tuple field a list (made a tuple); a bool is no int here, though Python says it is."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kept = check_value(type(config), f.name, value)
        if kept is not value:
            object.__setattr__(config, f.name, kept)


def check_value(cls: type, name: str, value: Any, key: str | None = None, where: str = "") -> Any:
    """`value` for the field `name` of the config dataclass `cls`, converted as check_types
    says, or a ValueError naming it as `key` (default: `name`) `where` it was written and
    quoting the value."""
    kind, optional = _field_kinds(cls).get(name, (None, False))
    if kind is None or (value is None and optional):
        return value
    if kind is str and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if kind is tuple and isinstance(value, list | tuple):
        value = tuple(value)
    if _is_kind(value, kind):
        return value
    default = {f.name: f.default for f in dataclasses.fields(cls)}.get(name)
    shown = default in (None, dataclasses.MISSING, ()) or kind is bool
    example = "" if shown else f", e.g. {default!r}"
    none = " (or null)" if optional else ""
    raise ValueError(
        f"invalid {key or name}={value!r} ({type(value).__name__}){where}: use "
        f"{_KIND_WORDS[kind]}"
        f"{none}{example}"
    )


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    if kind is tuple:
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    return isinstance(value, kind)


_KINDS: dict[type, dict[str, tuple[type | None, bool]]] = {}


def _field_kinds(cls: type) -> dict[str, tuple[type | None, bool]]:
    """{field: (kind, may be None)} of a config dataclass, read once from its annotations; a
    kind check_types does not know (a nested config) is None and goes unchecked."""
    if cls not in _KINDS:
        kinds = {}
        for name, hint in typing.get_type_hints(cls).items():
            args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            optional = type(None) in args
            rest = [typing.get_origin(a) or a for a in args if a is not type(None)]
            kind = rest[0] if len(rest) == 1 and rest[0] in _KIND_WORDS else None
            kinds[name] = (kind, optional)
        _KINDS[cls] = kinds
    return _KINDS[cls]


# -- reading: a YAML file, a section from its keys ---------------------------------------------


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds (an empty file: {}). A file that is missing is a
    FileNotFoundError; one unreadable, not YAML (the line and column of the fault) or not a
    mapping is a ValueError; each names the file."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(p)!r} not found: pass an existing YAML path")
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {str(p)!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        where, problem = "", str(e)
        if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
            mark = e.problem_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
            problem = ": ".join(filter(None, (e.context, e.problem)))
        raise ValueError(
            f"config file {str(p)!r} is not valid YAML{where}: {problem} (quote a value that "
            "holds ': ', '#' or starts with '{', '[', '*' or '&')"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {str(p)!r} must hold a mapping of keys (e.g. `max_num_seqs: 64`), "
            f"not a {type(data).__name__}: {data!r:.80}"
        )
    return data


def build_section(section_cls: type, values: dict[str, Any], section: str) -> Any:
    """A config dataclass from one YAML section (keys with dashes or underscores; a section
    with a `normalize` static method translates its other spellings first, which it names in
    `SPELLINGS`, {spelling: whose}); an unknown key is an error naming it and its close
    matches."""
    if not isinstance(values, dict):
        raise ValueError(f"config section {section!r} must be a mapping of keys, got {values!r}")
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    normalize = getattr(section_cls, "normalize", None)
    if normalize is not None:
        values = normalize(values)
    names = [f.name for f in dataclasses.fields(section_cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        other = getattr(section_cls, "SPELLINGS", {})
        whose = "".join(
            f", or {w} {sorted(k for k, v in other.items() if v == w)}"
            for w in dict.fromkeys(other.values())
        )
        raise ValueError(
            f"unknown key(s) {unknown} in config section {section!r}"
            f"{close_matches(unknown, [*names, *other])}; its keys are {sorted(names)}{whose}"
        )
    return section_cls(**values)


def close_matches(keys: list[str], names) -> str:
    """' (did you mean ...?)' for the keys with a close match among names, else ''."""
    hints = [
        f"{key!r} -> {match[0]!r}"
        for key in keys
        if (match := difflib.get_close_matches(key.replace("-", "_"), list(names), 1, 0.6))
    ]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def defaults(section_cls: type) -> dict[str, Any]:
    """Field defaults of a config section, for CLI flags."""
    return {f.name: f.default for f in dataclasses.fields(section_cls)}
