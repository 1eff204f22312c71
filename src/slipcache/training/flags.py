"""`slipcache train`'s flags, built from the fields of `TrainConfig`'s parts: each flag's help, choices and
spelling live in the field's metadata (`settings.flag`) and its default once, in the field; nothing is repeated
here.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from slipcache.data.presets import parse_table_sizes
from slipcache.options import positive_int, whole_number
from slipcache.training.config import CONFIG_FIELDS, PART_OF, SETTING_TYPES
from slipcache.training.settings import GROUPS, flag_strings


def int_list(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] for argparse, so a bad list is argparse's one-line usage error."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


_NAMED_TYPES = {"int_list": int_list, "positive_int": positive_int, "table_sizes": parse_table_sizes}


def _scalar_type(name: str) -> type:
    """The flag's value type: the field's, or its single-value form (`float | list[float]` -> float)."""
    kind = SETTING_TYPES[name]
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


def range_text(within: tuple[str, float, float, bool, bool]) -> str:
    """A setting's range as the help shows it: '> 0', '>= 1' (an upper bound of 2^31 or more is the
    representation's, said only when broken), or the interval itself ('[0, 1]')."""
    text, low, high, low_open, _ = within
    if high >= 2**31:
        return f"{'>' if low_open else '>='} {low:g}"
    return text


def flag_help(f: dataclasses.Field) -> str:
    """The field's help, then its default and range (a range checked by a library config is said there)."""
    notes = [f"default {text}"] if (text := default_text(f)) is not None else []
    if "within" in f.metadata:
        notes.append(f"range {range_text(f.metadata['within'])}")
    return f"{f.metadata['help']} ({'; '.join(notes)})" if notes else f.metadata["help"]


# The flags most runs need: `slipcache train --help` shows these, `--help-all` every flag (the research
# options of skipping, the schedule's details, ...).
COMMON_FLAGS = frozenset({
    "out", "resume", "allow_changes", "data", "vocab", "synthetic_generator", "table_sizes", "embeddings",
    "precision", "cache_size", "cache_rows", "policy", "optimizer", "lr", "storage_path", "embedding_dim",
    "bottom_mlp", "top_mlp", "seed", "batch_size", "epochs", "samples", "eval_every", "checkpoint_minutes",
    "quick", "tensorboard", "threads", "skip_rule",
})


class HelpAll(argparse.Action):
    """`--help-all`: the help with every flag, then exit (as `--help` does)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        for action in parser._actions:
            if getattr(action, "full_help", None) is not None:
                action.help = action.full_help  # type: ignore[attr-defined]
        parser.usage = None
        parser.epilog = None
        parser.print_help()
        parser.exit()


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting that has one, under its part's title; every flag defaults to 'not
    given' so that a config file's value is only overridden on purpose. `--help` shows `COMMON_FLAGS`,
    `--help-all` every flag."""
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    for name, f in CONFIG_FIELDS.items():
        meta = f.metadata
        if "help" not in meta:
            continue
        shown = flag_help(f) if name in COMMON_FLAGS else argparse.SUPPRESS
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": shown}
        strings = flag_strings(name, f)
        if SETTING_TYPES[name] is bool:
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            named = meta.get("type")
            kind = None if named else _scalar_type(name)
            kwargs["type"] = _NAMED_TYPES[named] if named else whole_number if kind is int else kind
            for key in ("choices", "metavar", "nargs", "const"):
                if key in meta:
                    kwargs[key] = meta[key]
        action = groups[PART_OF[name]].add_argument(*strings, **kwargs)
        action.full_help = flag_help(f)  # type: ignore[attr-defined]
