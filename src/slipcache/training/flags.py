"""`slipcache train`'s flags, built from `TrainConfig`'s fields: each flag's help, choices and spelling
live in the field's metadata (`config._flag`) and its default once, in the field; nothing is repeated here.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from slipcache.data.presets import parse_table_sizes
from slipcache.options import positive_int, whole_number
from slipcache.training.config import CONFIG_FIELDS, TrainConfig
from slipcache.training.settings import GROUPS, flag_strings

_TYPES = typing.get_type_hints(TrainConfig)


def int_list(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] for argparse, so a bad list is argparse's one-line usage error."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


_NAMED_TYPES = {"int_list": int_list, "positive_int": positive_int, "table_sizes": parse_table_sizes}


def _scalar_type(name: str) -> type:
    """The flag's value type: the field's, or its single-value form (`float | list[float]` -> float)."""
    kind = _TYPES[name]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None) and typing.get_origin(a) is not list)
    return kind


def default_text(f: dataclasses.Field) -> str | None:
    """The default as the help shows it: the field's value, or its words for a value that says nothing."""
    if "default_text" in f.metadata:
        return f.metadata["default_text"]
    if f.default is dataclasses.MISSING or f.default is None or isinstance(f.default, bool):
        return None
    value = f.default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}".replace(",", "") if isinstance(value, int) else str(value)


def flag_help(f: dataclasses.Field) -> str:
    text = default_text(f)
    return f"{f.metadata['help']} (default {text})" if text is not None else f.metadata["help"]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `TrainConfig` field that has one, under its group's title; every flag defaults to 'not
    given' so that a config file's value is only overridden on purpose."""
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    for name, f in CONFIG_FIELDS.items():
        meta = f.metadata
        if "help" not in meta:
            continue
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": flag_help(f)}
        strings = flag_strings(name, f)
        if _TYPES[name] is bool:
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            named = meta.get("type")
            kind = None if named else _scalar_type(name)
            kwargs["type"] = _NAMED_TYPES[named] if named else whole_number if kind is int else kind
            for key in ("choices", "metavar", "nargs", "const"):
                if key in meta:
                    kwargs[key] = meta[key]
        groups[meta["group"]].add_argument(*strings, **kwargs)
