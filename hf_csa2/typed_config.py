"""Typed, bounded YAML configs (conversion plans, training recipes): the field types they share,
the one-line error text for a bad value, and ``--set path=value`` overrides.

A config is a tree of pydantic dataclasses with ``extra="forbid"``; every field carries its type,
bounds and a description. :func:`describe` turns a pydantic ``ValidationError`` into one line
naming each bad field and what it allows, worded from the annotation itself, so the allowed
values in an error and in the generated docs cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import annotated_types
import yaml
from pydantic import ConfigDict, Field, Strict, ValidationError

CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict(), Field(min_length=1)]


def int_in(low: int, high: int):
    return Annotated[int, Strict(), Field(ge=low, le=high)]


def number_in(high: float, *, positive: bool = True):
    bound = Field(gt=0, le=high) if positive else Field(ge=0, le=high)
    return Annotated[float, Strict(), bound]


def doc(text: str):
    """A field's meaning, kept in the JSON schema (reference docs are generated from it)."""
    return Field(description=text)


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def check_keys(data: Any, where: str, error: type[Exception], root_name: str) -> None:
    """YAML allows non-string keys (``1: x``, ``null: y``); a config's keys are field names."""
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(key, str):
                raise error(f"{where} has the key {key!r}; allowed: field names (strings)")
            check_keys(value, f"{where}.{key}" if where != root_name else key, error, root_name)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            check_keys(value, f"{where}[{i}]", error, root_name)


def path_text(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def unwrap(annotation):
    """The dataclass or base type behind Optional[...] / Annotated[...]."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin is Union:
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        else:
            return annotation


def _inner_metadata(annotation) -> list:
    """Constraints of an Annotated type inside Optional[...] (pydantic keeps them there)."""
    found = []
    for arg in typing.get_args(annotation) if typing.get_origin(annotation) is Union else []:
        if typing.get_origin(arg) is Annotated:
            found += list(typing.get_args(arg)[1:])
    return found


def field_info(root, loc: tuple):
    """The pydantic FieldInfo of the field at ``loc`` under the dataclass ``root``, or None."""
    cls, info = root, None
    for part in loc:
        if isinstance(part, int) or not dataclasses.is_dataclass(cls):
            continue
        info = cls.__pydantic_fields__.get(part)
        if info is None:
            return None
        cls = unwrap(info.annotation)
    return info


def allowed(root, loc: tuple) -> str:
    """Words for what the field at ``loc`` allows, from its annotation and bounds."""
    info = field_info(root, loc)
    if info is None:
        return ""
    base = unwrap(info.annotation)
    bounds = {}
    for meta in [*info.metadata, *_inner_metadata(info.annotation)]:
        for item in getattr(meta, "metadata", [meta]):  # FieldInfo objects nest their constraints
            for name in ("ge", "gt", "le"):
                if isinstance(item, getattr(annotated_types, name.capitalize())):
                    bounds[name] = getattr(item, name)
    if typing.get_origin(base) is list:
        base = unwrap(typing.get_args(base)[0])
        prefix = "a list of "
    else:
        prefix = ""
    if typing.get_origin(base) is Literal:
        return prefix + ", ".join(str(v) for v in typing.get_args(base))
    if base is bool:
        return "true or false (a YAML boolean, unquoted)"
    if base is str:
        return prefix + "a non-empty string"
    if dataclasses.is_dataclass(base):
        return f"a mapping with the fields {', '.join(field_names(base))}"
    kind = "an integer" if base is int else "a finite number"
    low = f" >= {bounds['ge']}" if "ge" in bounds else (f" > {bounds['gt']}" if "gt" in bounds else "")
    high = f" and <= {_number_text(bounds['le'])}" if "le" in bounds else ""
    return prefix + kind + low + high


def _number_text(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def yaml_hint(value) -> str:
    """PyYAML (YAML 1.1) reads ``1e-4`` and ``1e11`` as text: say how to write the number."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return ""
        return f" (YAML reads {value} as text; write it with a dot, e.g. {number:.1e})"
    return ""


def describe(err: ValidationError, root, root_name: str) -> str:
    """One line for all of a ValidationError's problems (``root_name``: what the top level is
    called in the message, e.g. "plan" or "recipe")."""
    parts = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = path_text(loc) or root_name
        if e["type"] == "value_error":  # checks across fields already name them
            parts.append(str(e["msg"]).removeprefix("Value error, "))
        elif e["type"] == "unexpected_keyword_argument":
            parent = field_info(root, loc[:-1])
            section = root if parent is None else unwrap(parent.annotation)
            names = field_names(section) if dataclasses.is_dataclass(section) else []
            parts.append(f"unknown key {loc[-1]!r} in {path_text(loc[:-1]) or root_name}; allowed: {', '.join(names)}")
        elif e["type"] == "missing":
            parts.append(f"{path_text(loc[:-1]) or root_name} needs the field {loc[-1]!r} ({allowed(root, loc)})")
        else:
            value = e.get("input")
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            problem = "not a mapping" if e["type"] == "dataclass_type" else e["msg"][:1].lower() + e["msg"][1:]
            parts.append(f"{where}={shown}: {problem}; allowed: {allowed(root, loc)}{yaml_hint(value)}")
    return "; ".join(parts)


def set_fields(data: dict[str, Any], assignments: list[str], error: type[Exception], example: str,
               max_depth: int = 2) -> dict[str, Any]:
    """Mapping ``data`` with ``a.b=VALUE`` assignments applied (VALUE is read as YAML: ``3``,
    ``1.0e-4``, ``true``, ``[full, reuse]``); the config built from it validates them. A section
    left empty (``None``) or set to ``true`` becomes a mapping when one of its fields is set."""
    data = _copy(data or {})
    for item in assignments:
        key, sep, text = item.partition("=")
        path = key.strip().split(".")
        if not sep or not all(path) or len(path) > max_depth:
            raise error(f"--set {item!r}; allowed: {example}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise error(f"--set {item!r}: the value is not valid YAML") from None
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None or child is True:
                child = {}
            if not isinstance(child, dict):
                raise error(f"--set {item!r}: {'.'.join(path[:depth + 1])!r} is {child!r}, not a mapping")
            node[part] = child
            node = child
        node[path[-1]] = value
    return data


def read_yaml_file(path, error: type[Exception], kind: str, examples: str):
    """The data in a YAML config file, or None when it is empty (or comments only); a folder, a
    missing or unreadable file, bytes that are not UTF-8 and invalid YAML are refused with
    ``error`` naming the file (``kind``: "plan", "recipe"; ``examples``: where good ones are)."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{kind} {str(path)!r} is a folder; allowed: a YAML file (see {examples})")
    if not path.is_file():
        raise error(f"{kind} file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{kind} file {str(path)!r} is not UTF-8 text; allowed: a YAML file (see {examples})") from None
    except OSError as err:
        raise error(f"cannot read {kind} file {str(path)!r}: {err.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        raise error(f"{kind} file {str(path)!r} is not valid YAML{at}: {getattr(err, 'problem', None) or err}") from None


def _copy(value):
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, dict) else value


__all__ = ["Bool", "CONFIG", "Text", "allowed", "check_keys", "describe", "doc", "field_info", "field_names",
           "int_in", "number_in", "path_text", "read_yaml_file", "set_fields", "unwrap", "yaml_hint"]
