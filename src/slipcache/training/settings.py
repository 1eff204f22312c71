"""How a setting is described, once: `flag` puts its flag (help, choices, spelling), what a resume may do
with it (`resume=`), its range (`within=`) and the library parts' fields it sets (`sets=`) in its dataclass
field's metadata. The part configs of `training/parts.py` hold the settings; the flags (`training/flags.py`),
the config-file keys, the resume check (`training/rundir.py`) and the library configs (`part_options`) are
built from that metadata, and `check_settings` checks a part's fields from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

from slipcache.embedding.config import FLOAT32_MAX, EmbeddingConfig
from slipcache.errors import SettingError, SlipcacheError
from slipcache.model import ModelConfig
from slipcache.staleness.config import StalenessConfig

# What a resume may do with a setting: "fixed": the checkpoint's state depends on it (data, shapes,
# storage, shuffling): never changed; "changeable": changed with --allow-changes, and recorded; "free":
# where and how this process works and reports, not what it computes: may differ, unrecorded.
RESUME = ("fixed", "changeable", "free")
# The parts of a TrainConfig (`training/parts.py`), in the order `slipcache train --help` shows their flags.
GROUPS = {
    "run": "run directory",
    "data": "data",
    "embeddings": "embedding tables",
    "model": "model",
    "schedule": "schedule and reports",
    "process": "this process",
    "skipping": "stale-input skipping (docs/skipping.md)",
}
# The library's configs a setting configures (`sets="part.field"`); a setting that names one takes its default
# and its range from that field (the part config checks it by building that config: `check_library`).
PART_CONFIGS: dict[str, type] = {"embedding": EmbeddingConfig, "model": ModelConfig, "staleness": StalenessConfig}
_INHERIT: Any = object()  # the default of the first part's field the setting sets
# The bounds `within=` may name besides numbers.
_BOUNDS = {"inf": math.inf, "float32": FLOAT32_MAX, "2**31": 2**31, "2**32": 2**32}


def _part_default(target: str, scale: float) -> tuple[Any, Any]:
    """(default, factory) of the part's field `target` ("part.field"), in the setting's unit."""
    part, name = target.split(".")
    f = next(f for f in dataclasses.fields(PART_CONFIGS[part]) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return None, f.default_factory
    default = f.default
    assert default is not dataclasses.MISSING, target  # every part field has a default
    return (default if scale == 1 else default / scale), None


def flag(default: Any = _INHERIT, help: str = "", *, resume: str, sets: str | tuple[str, ...] = (),
         within: str | None = None, scale: float = 1, factory: Any = None, **meta: Any) -> Any:
    """A setting: a `slipcache train` flag when it has a `help`, else set by config files (or --quick) only.

    `resume`: one of RESUME; `within`: its range as an interval ("(0, 1]", "[1, inf)"), of each element of a
    list; `sets`: the library parts' fields it sets ("part.field"), the value times `scale`; the default (and
    the range, checked by that part) is the first of them's unless given. Flag keys in `meta`: `flag` (the
    option strings when not `--field-name`), `choices`, `metavar`, `type`, `nargs`/`const`, `default_text`
    (the default in words when the value says nothing); `doc`: what a file-only setting means."""
    if resume not in RESUME:
        raise ValueError(f"resume must be one of {RESUME}")
    targets = (sets,) if isinstance(sets, str) else tuple(sets)
    if default is _INHERIT:
        default, factory = _part_default(targets[0], scale)
    metadata = {"resume": resume, "sets": targets, "scale": scale, **meta}
    if within is not None:
        metadata["within"] = _interval(within)
    if help:
        metadata["help"] = help
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _interval(text: str) -> tuple[str, float, float, bool, bool]:
    """'(0, 1]' -> (text, low, high, low_open, high_open)."""
    low, high = (part.strip() for part in text[1:-1].split(","))
    return text, _BOUNDS.get(low, 0) or float(low), _BOUNDS.get(high, 0) or float(high), text[0] == "(", text[-1] == ")"


def _range_problem(value: float, within: tuple[str, float, float, bool, bool]) -> str | None:
    """What is wrong with `value` for the range `within`, in the words the flags have always used."""
    text, low, high, low_open, high_open = within
    too_low = not (value > low if low_open else value >= low)  # `not`: nan is out of every range
    too_high = not (value < high if high_open else value <= high)
    wide = high == math.inf or high >= 2**31  # a limit of the representation, not of the meaning
    if too_low and low == 0 and low_open and wide:
        return "must be positive"
    if too_low and high == math.inf:
        return "must be 0 or more" if low == 0 else f"must be at least {low:g}"
    if too_low and low == 0 and high == FLOAT32_MAX:  # a rate: 0 keeps those parameters as they are
        return "must be >= 0"
    if too_high and high == FLOAT32_MAX:
        return f"must fit a float32 (at most {FLOAT32_MAX:.3g})"
    if too_high and wide and low == 0 and low_open:
        return f"must be at most {text[1:-1].split(',')[1].strip()}"
    return f"must be in {text}" if too_low or too_high else None


_HINTS: dict[type, dict[str, Any]] = {}  # each part's type hints, read once


def _type_hints(kind: type) -> dict[str, Any]:
    if kind not in _HINTS:
        _HINTS[kind] = typing.get_type_hints(kind)
    return _HINTS[kind]


def check_settings(part: Any) -> None:
    """Check a part config's fields from their metadata: the type (a value from a crafted checkpoint, a config
    file or an API call may be anything: "256", 1e100; what trains is the typed value), a finite number that
    fits 64 bits, the choices and the range; one `SlipcacheError` naming the setting (`setting_name`)."""
    kinds = _type_hints(type(part))
    for f in dataclasses.fields(part):
        value = coerce(f.name, kinds[f.name], getattr(part, f.name))
        values = value if isinstance(value, list) else [value]
        meta = f.metadata
        for item in values:
            if isinstance(item, float) and not math.isfinite(item):
                raise SlipcacheError(f"{setting_name(f.name, f)} must be a finite number, got {item}")
            if isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 2**63:  # exact: any size
                raise SlipcacheError(f"{setting_name(f.name, f)} must fit a 64-bit integer, got {_digits(item)}")
        for item in values if meta.get("choices") is not None else []:  # precision: of each table
            if item not in (*meta["choices"], None):
                allowed = ", ".join(meta["choices"])
                raise SlipcacheError(f"{setting_name(f.name, f)} must be one of {allowed}, got {item!r}")
        if "within" in meta:
            for item in values:
                problem = item is not None and _range_problem(item, meta["within"])
                if problem:
                    raise SlipcacheError(f"{setting_name(f.name, f)} {problem}, got {item}")
        setattr(part, f.name, value)


def check_library(part: Any, library: str, build: Callable[[dict[str, Any]], Any]) -> None:
    """Check the settings of `part` that set fields of the library config `library` (one of PART_CONFIGS) by
    building it with them (`build(options)`): the range is that config's, written there once; its error is
    said again naming the setting, as the user spelled it."""
    fields = {f.name: f for f in dataclasses.fields(part)}
    spelled_as = {target.split(".")[1]: flag_strings(name, f)[0] for name, f in fields.items()
                  for target in f.metadata["sets"] if target.startswith(f"{library}.")}
    try:
        build(part_options(part, fields, library))
    except SettingError as exc:
        for name, f in fields.items():
            if f"{library}.{exc.name}" in f.metadata["sets"]:
                spelled, message = setting_name(name, f), str(exc)
                if exc.predicate is not None and f.metadata["scale"] == 1:
                    raise SlipcacheError(f"{spelled} {exc.predicate.format_map(spelled_as)}") from None
                if message.startswith(exc.name + " ") and f.metadata["scale"] == 1:  # else: the part's unit
                    raise SlipcacheError(spelled + message[len(exc.name):]) from None
                raise SlipcacheError(f"{spelled}: {message}") from None
        raise SlipcacheError(str(exc)) from None


def part_options(config: Any, fields: dict[str, dataclasses.Field], part: str) -> dict[str, Any]:
    """The settings of `config` (its `fields`) that set fields of `part` (one of PART_CONFIGS), as {part's field:
    value}; a scaled setting gives a whole number of the part's unit."""
    options = {}
    for name, f in fields.items():
        for target in f.metadata["sets"]:
            owner, key = target.split(".")
            if owner == part:
                value, scale = getattr(config, name), f.metadata["scale"]
                options[key] = value if scale == 1 or value is None else int(value * scale)
    return options


def coerce(name: str, kind: Any, value: Any) -> Any:
    """Check a config-file value against the setting's type `kind` (ints are accepted where floats are)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(kind):
            return None
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if isinstance(value, list):  # `str | list[str]`: one value or one per table
            listed = [a for a in options if typing.get_origin(a) is list]
            element = typing.get_args(listed[0])[0] if listed else None
            if element is not None and value and all(_matches(element, v) for v in value):
                return [_number(name, element, v) if element in (int, float) else v for v in value]
        kind = options[0]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if typing.get_origin(kind) is list:
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return list(value)
    elif kind is bool and isinstance(value, bool):
        return value
    elif kind in (int, float) and is_number and (kind is float or _is_whole(value)):
        return _number(name, kind, value)
    elif kind is str and isinstance(value, str):
        return value
    raise SlipcacheError(f"{name}: expected {getattr(kind, '__name__', kind)}, got {value!r}")


def _is_whole(value: int | float) -> bool:
    """An integer, or a float with no fraction (1e6); exact for ints of any size (TOML's have no limit)."""
    return isinstance(value, int) or (math.isfinite(value) and value.is_integer())


def _number(name: str, kind: type, value: int | float) -> int | float:
    """`value` as `kind`, exactly: an int stays an int whatever its size (its range is checked by the
    settings' check, exactly), a float too large for a float64 is one line naming the setting."""
    if kind is int:
        return int(value)
    try:
        return float(value)
    except OverflowError:
        raise SlipcacheError(f"{name}: {_digits(int(value))} is beyond the range of a floating-point number") from None


def _digits(value: int) -> str:
    """A huge integer, shortened for a one-line message: its first digits and how many there are."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def _matches(kind: type, value: Any) -> bool:
    """Whether a config-file list element fits `kind` (ints are accepted where floats are)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is float:
        return number
    if kind is int:
        return number and _is_whole(value)
    return isinstance(value, kind)


def flag_strings(name: str, f: dataclasses.Field) -> tuple[str, ...]:
    """A setting's flags (`--dim` for embedding_dim): the field's own spelling, else its name with dashes."""
    return f.metadata.get("flag") or (f"--{name.replace('_', '-')}",)


def setting_name(name: str, f: dataclasses.Field) -> str:
    """A setting as errors name it: its flag (what most users typed), and its config key where they differ."""
    if "help" not in f.metadata:  # no flag: a config file's key alone
        return name
    spelled = flag_strings(name, f)[0]
    return spelled if spelled == f"--{name.replace('_', '-')}" else f"{spelled} ({name})"


def read_settings_file(
    path: str | Path, fields: dict[str, dataclasses.Field], coerce_value: Callable[[str, Any], Any],
    sections: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Read a TOML (.toml) or YAML (.yaml/.yml/.json) file of settings into {field: value}, each value checked
    by `coerce_value(name, value)`; a key that is not one of `fields` is one line naming the valid ones.
    `sections`: {field: part}: a mapping under a part's name holds that part's fields (`[embeddings]`)."""
    path = Path(path)
    text = _read_config_text(path)
    try:
        if path.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        elif path.suffix == ".json":  # JSON's own rules: 1e-3 is a number (YAML 1.1 reads it as a string)
            import json

            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text) or {}
    except Exception as exc:  # parse errors of every format
        raise SlipcacheError(f"cannot parse config file {path}: {exc}".splitlines()[0]) from exc
    if not isinstance(raw, dict):
        raise SlipcacheError(f"config file {path} must hold a mapping of keys to values")
    raw = raw.get("train", raw) if isinstance(raw.get("train"), dict) else raw
    parts = set((sections or {}).values())
    entries: list[tuple[str, Any, str | None]] = []  # (key, value, the part it was written under)
    for key, value in raw.items():
        if str(key) in parts and isinstance(value, dict):
            entries += [(str(k), v, str(key)) for k, v in value.items()]
        else:
            entries.append((str(key), value, None))
    values = {}
    for key, value, part in entries:
        name = key.replace("-", "_")
        if name not in fields:
            where = f"[{part}] " if part else ""
            raise SlipcacheError(f"unknown key {where}{key!r} in config file {path}; {_closest_keys(name, fields)}")
        if part is not None and sections is not None and sections[name] != part:
            raise SlipcacheError(f"key {key!r} in config file {path} belongs to [{sections[name]}], not [{part}]")
        if name in values:
            raise SlipcacheError(f"key {key!r} is set twice in config file {path}")
        values[name] = coerce_value(name, value)
    return values


MAX_CONFIG_BYTES = 1 << 20  # a settings file is a few KB; a larger one is not a settings file


def _read_config_text(path: Path) -> str:
    """The text of a config file: a regular file (a pipe like `--config <(...)` too, read to its end), at
    most MAX_CONFIG_BYTES; a directory, a device or a missing path is one line saying which."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise SlipcacheError(f"config file not found: {path}") from None
    except OSError as exc:
        raise SlipcacheError(f"cannot read config file {path}: {exc.strerror}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        kind = "a directory" if stat.S_ISDIR(mode) else "a device or socket, not a file"
        raise SlipcacheError(f"config file {path} is {kind}")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise SlipcacheError(f"cannot read config file {path}: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise SlipcacheError(f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a settings file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SlipcacheError(f"config file {path} is not UTF-8 text (byte {exc.start})") from None


def _closest_keys(name: str, fields: dict[str, dataclasses.Field]) -> str:
    """What an unknown config-file key most likely meant: the key of the flag spelled so (`dim`: --dim is
    embedding_dim), else the nearest keys, else every valid key."""
    by_flag = {spelled[2:].replace("-", "_"): key for key, f in fields.items() for spelled in flag_strings(key, f)}
    if name in by_flag:
        key = by_flag[name]
        switch_off = fields[key].default is True  # `--no-...`: the flag sets its key to false
        return f"the flag --{name.replace('_', '-')} is the key {key!r}{' set to false' if switch_off else ''}"
    spelled, sharing = difflib.get_close_matches(name, list(fields), n=3), _keys_sharing_words(name, fields)
    near = list(dict.fromkeys([*sharing[:1], *spelled, *sharing]))[:3]
    if near:
        return f"did you mean {' or '.join(repr(k) for k in near)}?"
    return "no key is spelled like it; `slipcache train --help-all` lists every setting (the flag --a-b is the key a_b)"


# Words other tools use for a setting, and the word slipcache's keys use for it.
_KEY_WORDS = {"learning": "lr", "rate": "lr", "dimension": "dim", "emb": "embedding", "size": "size",
              "hidden": "mlp", "layers": "mlp", "iterations": "samples", "steps": "steps", "epoch": "epochs",
              "quantization": "precision", "dtype": "precision", "bits": "precision", "capacity": "cache"}


def _keys_sharing_words(name: str, fields: dict[str, dataclasses.Field]) -> list[str]:
    """Keys that share a word with `name` (`learning_rate` -> lr, dense_lr, ...): most words shared first,
    then the fewest other words, then the closest spelled."""
    words = {_KEY_WORDS.get(w, w) for w in name.lower().replace("-", "_").split("_") if len(w) > 1}

    def rank(key: str) -> tuple[int, int, float]:
        parts = set(key.split("_"))
        return -len(words & parts), len(parts - words), -difflib.SequenceMatcher(None, name, key).ratio()

    return sorted((key for key in fields if words & set(key.split("_"))), key=rank)


def change_lines(entry: dict[str, Any]) -> list[str]:
    """One line per setting a resume changed (an entry of config.json's `changed_on_resume`):
    "lr 0.5 → 0.3, at sample 1,280". A change of data is said by its own warning, not as digests."""
    samples = int(entry.get("samples") or 0)
    return [
        f"{name} {_setting_text(old)} → {_setting_text(new)}, at sample {samples:,}"
        for name, (old, new) in entry.get("changes", {}).items()
        if name != "data_fingerprint"
    ]


def _setting_text(value: Any) -> str:
    return "none" if value is None else str(value)
