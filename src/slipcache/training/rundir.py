"""The run directory: where a run writes, and what `--resume` may continue from.

`--out` must be new, empty, or a run that stopped before its first checkpoint; `--resume` writes only into
the run it names, and refuses setting changes the checkpoint's state depends on.
"""

from __future__ import annotations

import json
import logging
import typing
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slipcache.errors import SlipcacheError
from slipcache.safe_files import write_atomic
from slipcache.training import checkpoint as ckpt
from slipcache.training import runlock
from slipcache.training.config import CONFIG_FIELDS, TrainConfig, config_from_saved
from slipcache.training.run_state import check_checkpoint
from slipcache.training.runlock import LOCK_NAME

if typing.TYPE_CHECKING:
    from slipcache.training.run_state import TrainingCheckpoint

logger = logging.getLogger(__name__)


def new_run_dir() -> Path:
    """runs/<UTC timestamp>, with a counter when two runs start in the same second."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / stamp
    n = 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{stamp}-{n}"
    return path


def remove_empty_dirs(directories: list[Path]) -> None:
    """Remove the given directories, deepest first, while they are empty: a failed start leaves no empty run
    directory behind (rmdir takes neither files nor a link)."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


def write_json(path: Path, value: Any) -> None:
    """Write JSON atomically: a reader never sees half a file, a link there is replaced, not followed."""
    write_atomic(path, json.dumps(value, indent=2, default=str) + "\n")


def write_events(path: Path, events: list[dict[str, Any]]) -> None:
    """metrics.jsonl from the events a run holds (a resumed run rewrites it from its checkpoint's), atomically."""
    write_atomic(path, "".join(json.dumps(e) + "\n" for e in events))


def warn(message: str) -> None:
    """A warning that does not stop the run (on stderr under the command: stdout stays the run's own output)."""
    logger.warning(f"slipcache train: warning: {message}")


def _is_run_dir(path: Path) -> bool:
    """Whether `path` is a directory `slipcache train` made (its config.json names a run's dataset)."""
    try:
        saved = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"dataset", "embeddings", "seed"} <= saved.keys()


def holds_run_or_dataset(path: Path, names: list[str], files: list[str]) -> str | None:
    """"run" or "dataset" when directory `path` (holding subdirectories `names` and `files`) is one that
    slipcache wrote, else None; for commands that replace directories and must never replace these."""
    if LOCK_NAME in files or _is_run_dir(path) or has_checkpoint(path):
        return "run"
    if "meta.json" in files:
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            meta = None
        if isinstance(meta, dict) and meta.get("format") == "slipcache-dataset":
            return "dataset"
    if "synthetic.json" in files:  # a TorchRec-layout dataset that `synth` wrote
        return "dataset"
    return None


def has_checkpoint(run_dir: Path) -> bool:
    """Whether the run directory holds a checkpoint file (or a step of N processes), so that `--resume`
    has something to load."""
    directory = run_dir / "checkpoints"
    return directory.is_dir() and any(p.suffix == ".pt" or p.name.startswith("step-") for p in directory.iterdir())


def prepare_out_dir(path: Path, *, restart_ok: bool) -> Path:
    """Create the run directory `path` (absolute): new, empty, or, with `restart_ok`, a run that stopped
    before its first checkpoint. Anything else holds someone's files or another run: refused."""
    path = path.expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise SlipcacheError(f"--out {path} is a file, not a directory")
    # Our temp files of a write killed midway (before config.json existed) and the lock of a run that is
    # starting do not make a directory anyone's (the lock then decides who writes it).
    entries = (
        [p for p in path.iterdir() if not (ckpt.is_partial_write(p.name) or p.name == LOCK_NAME)]
        if path.is_dir()
        else []
    )
    if entries:
        if not _is_run_dir(path):
            raise SlipcacheError(
                f"--out {path} is not empty and is not a slipcache run directory; choose a new or empty one"
            )
        if has_checkpoint(path) or not restart_ok:
            raise SlipcacheError(f"run directory {path} already holds a run; use --resume {path} or another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SlipcacheError(f"cannot create run directory {path}: {exc.strerror or exc}") from exc
    return path


def locate_checkpoint(name: str | Path, flag: str = "--checkpoint") -> tuple[Path, Path | None]:
    """(checkpoint file, the run directory holding it or None for a loose file) that `name` designates:
    a run directory, its checkpoints directory (or any directory holding latest.pt), or a checkpoint file.
    The one way `--resume`, `slipcache eval` and `slipcache export` find a run's checkpoint; `flag` names
    the option in errors. A run of N processes has no such file: see `saved_run.find_checkpoint`."""
    path = Path(name).expanduser().resolve()
    if path.is_dir():
        if path.name == "checkpoints" or (path / ckpt.LATEST).is_file():
            return path / ckpt.LATEST, path.parent if _is_run_dir(path.parent) else None
        if _is_run_dir(path) or (path / "checkpoints").is_dir():
            return path / "checkpoints" / ckpt.LATEST, path
        if path.parent.name == "checkpoints" and _is_run_dir(path.parent.parent):  # a step of N processes
            return path / ckpt.LATEST, path.parent.parent
        raise SlipcacheError(f"{flag} {path}: not a slipcache run directory or checkpoint file")
    if path.is_file():
        if path.parent.name == "checkpoints" and _is_run_dir(path.parent.parent):
            return path, path.parent.parent
        return path, None
    raise SlipcacheError(f"{flag} {path}: no such run directory or checkpoint file")


def resolve_checkpoint(name: str | Path, flag: str = "--checkpoint") -> tuple[Path, Path | None, bool]:
    """(checkpoint, its run directory or None, whether N processes wrote it) that `name` designates (see
    `locate_checkpoint`): a checkpoint file or step directory named as such, else (a run directory, its
    checkpoints directory, its latest.pt) the newest complete checkpoint there (`newest_checkpoint`)."""
    file, run_dir = locate_checkpoint(name, flag)
    if file.name == ckpt.LATEST:
        if (file.parent / ckpt.STEP_MANIFEST).is_file():  # a step directory of N processes, named
            return file.parent, run_dir, True
        newest = newest_checkpoint(file.parent)
        if newest is not None:
            return newest[0], run_dir, newest[1]
    return file, run_dir, False


def newest_checkpoint(directory: Path) -> tuple[Path, bool] | None:
    """(the newest complete checkpoint of a run's checkpoints directory, whether N processes wrote it).

    A run can be continued by 1 process, then N, then 1 again: the newest is the one furthest in training
    (its samples), whoever wrote it; at equal samples, the later written. Complete means written to the
    end: a periodic file under its final name (written aside, then renamed), a step directory with its
    manifest (written last). `latest.pt` is the newest periodic file unless a kill fell between writing
    that file and linking it; then the newer periodic file wins. Damaged bytes are found when it is read
    (the error names the older complete ones)."""
    if not directory.is_dir():
        return None
    steps = ckpt.complete_steps(directory)
    candidates = [(samples, _written(step / ckpt.STEP_MANIFEST), step, True) for samples, step in steps]
    periodic = ckpt.periodic_checkpoints(directory)  # (samples, path), newest last
    latest = directory / ckpt.LATEST
    single: tuple[int, Path] | None = periodic[-1] if periodic else None
    if latest.is_file():
        same = [item for item in periodic if _same_file(item[1], latest)]
        position = same[0][0] if same else (single[0] if single else -1)  # a copy (no hard links): the newest
        if single is None or position >= single[0]:
            single = (position, latest)
    if single is not None:
        candidates.append((single[0], _written(single[1]), single[1], False))
    if not candidates:
        return None
    _, _, path, sharded = max(candidates, key=lambda c: (c[0], c[1]))
    return path, sharded


def _written(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False



def load_resume(
    config: TrainConfig, read_checkpoint: Callable[[Path, Path | None], TrainingCheckpoint | None]
) -> tuple[TrainingCheckpoint | None, dict[str, Any], TrainConfig, dict[str, list[Any]]]:
    """(checkpoint or None, the run's saved config, the config to continue with, changed settings).
    `read_checkpoint(path, run_dir)`: the run backend's reader (`RunBackend.read_resume_checkpoint`).

    The resumed run writes into the directory `--resume` names, whatever the checkpoint says (a copied
    run directory stays a copy), or into a new or empty `--out`; never into another run. A run that
    stopped before its first checkpoint (a full disk) starts again from its config.json.
    """
    path, home, _ = resolve_checkpoint(config.run.resume or "", "--resume")  # the newest, whoever wrote it
    if config.run.out is not None and (home is None or Path(config.run.out).expanduser().resolve() != home):
        run_dir = prepare_out_dir(Path(config.run.out), restart_ok=False)
    elif home is None:
        raise SlipcacheError(f"checkpoint {path} is not inside a run directory; give a new --out for the resumed run")
    else:
        run_dir = home
        # A live run is the first thing said, before anything about its checkpoints (it may have none yet).
        runlock.refuse_if_held(home)
    checkpoint = read_checkpoint(path, home)
    if checkpoint is not None:
        fill_checkpoint_event(checkpoint.state, path)
    if checkpoint is None:
        assert home is not None
        warn(f"{home} has no checkpoint (it stopped before the first one); starting it again from the beginning")
        saved, where = json.loads((home / "config.json").read_text()), f"{home / 'config.json'}"
    else:
        saved, where = checkpoint.state["config"], f"checkpoint {path}"
    resumed = config_from_saved(saved, where)
    changes = _resume_changes(config, resumed)
    if changes:
        listing = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changes.items())
        if not config.run.allow_changes:
            raise SlipcacheError(
                f"resuming would change the run's definition ({listing}); leave these flags out, "
                "or pass --allow-changes to continue with them"
            )
        fixed = sorted(name for name in changes if CONFIG_FIELDS[name].metadata["resume"] == "fixed")
        if fixed:
            raise SlipcacheError(
                f"cannot change {', '.join(fixed)} when resuming, even with --allow-changes: "
                "the checkpoint's state depends on it"
            )
        taken = {name: new for name, (_, new) in changes.items()}
        if "epochs" in changes and "samples" not in changes:
            taken["samples"] = None  # derive the budget from the new epoch count
        resumed = resumed.replaced(**taken)
    this = {name: config.get(name) for name in ("resume", "progress", "allow_changes")}
    for name, f in CONFIG_FIELDS.items():  # how and where the run works (threads, paths): the run's unless given
        if f.metadata["resume"] == "free" and name not in _THIS_INVOCATION and _given(config, name):
            this[name] = config.get(name)
    resumed = resumed.replaced(**this, out=str(run_dir))
    return checkpoint, saved, resumed, {k: list(v) for k, v in changes.items()}


def fill_checkpoint_event(state: dict[str, Any], path: Path) -> None:
    """The checkpoint's own metrics.jsonl event was saved before its size was known: take it from the file
    (its write time stays unknown to the resumed run)."""
    events = state.get("progress", {}).get("events") or []
    last = events[-1] if events else None
    if isinstance(last, dict) and last.get("event") == "checkpoint" and last.get("bytes") is None and path.is_file():
        last["bytes"] = path.stat().st_size


# Free settings that belong to this command, not to the run: the other free ones (threads, huge pages, where
# the rows live, TensorBoard) are the run's until given again (a resume without --threads 1 stays on 1).
_THIS_INVOCATION = ("resume", "out", "allow_changes", "progress")


def _given(config: TrainConfig, name: str) -> bool:
    """Whether `name` was set on the command line or in the config file (`make_config` records which),
    whatever the value; a TrainConfig built directly has no such record: then a value other than the
    default counts as given."""
    if config.given is not None:
        return name in config.given
    return config.get(name) != _DEFAULTS.get(name)


_DEFAULTS = TrainConfig()


def _resume_changes(config: TrainConfig, saved: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Settings given for the resume (`_given`) that differ from the run's."""
    changes = {}
    for name, f in CONFIG_FIELDS.items():
        if f.metadata["resume"] == "free" or not _given(config, name):  # free: where and how this process works
            continue
        value, old = config.get(name), saved.get(name)
        if name == "data" and value is not None and old is not None:
            value = str(Path(value).expanduser().resolve())
        if value != old:
            changes[name] = (old, value)
    return changes


def load_training_checkpoint(path: Path, *, use: str = "--resume") -> dict[str, Any]:
    """A verified training checkpoint; when it is damaged or missing, the error names the complete older
    checkpoints beside it and how to go on from the newest (`use`: the flag that takes it, e.g.
    `--checkpoint` for eval)."""
    try:
        state = ckpt.load_checkpoint(path, lazy=True)  # the tables are read into the model (load_model_state)
    except ckpt.CorruptCheckpointError as exc:
        older = [p for p in ckpt.complete_checkpoints(path.parent) if p.name != path.name]
        if not older:
            raise
        names = ", ".join(p.name for p in older)
        raise SlipcacheError(
            f"{exc}; complete older checkpoints: {names}; to use the newest: {use} {older[0]}"
        ) from exc
    check_checkpoint(state, path)
    return state


def run_record(
    config: TrainConfig,
    dataset: Any,
    dataset_dir: Path,
    saved: dict[str, Any],
    changes: dict[str, list[Any]],
    state: dict[str, Any] | None,
) -> dict[str, Any]:
    """What config.json and every checkpoint record: the resolved config, the dataset and its fingerprint,
    the run's id, and the settings changed on each resume. Data other than the run's is refused here
    (`--allow-changes` proceeds and records it); a run of an older slipcache had no fingerprint: it
    gets one now."""
    from slipcache.data.fingerprint import check_same_data, fingerprint

    current = fingerprint(dataset)
    diff = check_same_data(
        saved.get("data_fingerprint"), current, allow=config.run.allow_changes, what=f"dataset {dataset_dir}"
    )
    if diff is not None:
        changes["data_fingerprint"] = [saved["data_fingerprint"].get("digest"), current["digest"]]
        warn(f"dataset {dataset_dir} is not the data the run trained on ({diff}); continuing (--allow-changes)")
    record = {
        **config.flat(),
        "dataset": str(dataset_dir),
        # how the dense values were transformed (files read in place: on read, or not at all when they hold
        # TorchRec's transformed values), so a run records what its inputs were
        "dense_transform": dataset.meta.get("dense_transform"),
        "data_fingerprint": current,
        "run_id": saved.get("run_id") or uuid.uuid4().hex[:16],
    }
    history = list(saved.get("changed_on_resume", []))
    if changes:
        history.append({"samples": state["progress"]["samples"] if state else 0, "changes": changes})
    if history:
        record["changed_on_resume"] = history
    return record
