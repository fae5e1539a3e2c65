"""Settings from plain data: a frozen dataclass built from a mapping (nested sections, unknown keys named with
the nearest valid one), each value coerced to its field's type, read from a JSON or YAML file; every error
one line that names the key and says how to fix it. Standard library only (YAML's reader when a file asks)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import pathlib
import typing
from typing import Any

CHUNK_ALIGN_BYTES = 8192  # the grain of chunk_bytes: units.ALIGN_NUMEL fp32 elements


def fail(path: str, value: Any, why: str, fix: str) -> typing.NoReturn:
    raise ValueError(f"{path}={value!r}: {why}; {fix}")


def with_article(noun: str) -> str:
    """'an int', 'a float': a type's name as an error message reads it."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def build(cls, data: Any, path: str):
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        fail(path or "config", data, f"expected a mapping for {cls.__name__}", "see the config reference, docs/config.md")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(names)}"
            raise ValueError(f"{where}: unknown config key; {hint}")
        kwargs[key] = coerce_value(hints[key], value, where)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - fields all have defaults
        raise ValueError(f"{path or 'config'}: {e}") from None


def coerce_value(hint, value: Any, where: str):
    """`value` as a field of type `hint` holds it (a dataclass built from a mapping, a list made a tuple, 1e9
    made an int, "2.5G" made bytes for a `*_bytes` key); a value of the wrong type is a ValueError naming `where`."""
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            fail(where, value, "expected a list", "for example [0.9, 0.999]")
        return tuple(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 1e9 in YAML/JSON
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    base = [t for t in typing.get_args(hint) if t is not type(None)] if origin is not None else [hint]
    if value is None and type(None) in typing.get_args(hint):
        return None
    if base and base[0] is int and isinstance(value, str) and where.rsplit(".", 1)[-1].endswith("_bytes"):
        return parse_bytes(value, where)
    if base and base[0] in (int, float, str, bool) and not isinstance(value, base[0]):
        if base[0] is int and isinstance(value, float) and value.is_integer():
            return int(value)
        fail(where, value, f"expected {base[0].__name__}", f"write it as {with_article(base[0].__name__)}")
    return value


def parse_bytes(text: str, where: str) -> int:
    """A `*_bytes` key given as a size string ("2.5G", "512M", "64K", binary units) in bytes, read by the
    parser the command line's sizes use; anything else is one line naming the key."""
    from offload.swap.measure import parse_size  # here, not at the top: this module imports no torch

    try:
        return parse_size(text)
    except ValueError:
        fail(where, text, "not a size", 'write a byte count or a size such as "2.5G", "512M" or "64K"')


def read_settings_file(path: pathlib.Path, flag: str = "config") -> dict:
    """The mapping in a .json or .yaml file; anything else is a one-line ValueError naming the file."""
    where = f"{flag}={str(path)!r}"
    if not path.is_file():
        raise ValueError(f"{where}: no such file; pass the path of a .json or .yaml file")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not a text file; pass a .json or .yaml file") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:  # its message spans lines: keep the problem and where
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ValueError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e}{at}); "
                             "fix the file") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e}); fix the file or use .yaml") from None
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of keys at the top level, got a {type(data).__name__}; "
                         "see the config reference, docs/config.md")
    return data or {}


def set_dotted(data: dict, path: str, value) -> None:
    """data["a"]["b"] = value for path "a.b", making the sections on the way."""
    *parents, last = path.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value
