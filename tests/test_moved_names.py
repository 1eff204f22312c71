"""Old import paths of moved names still resolve for one release, and say where the name went, once."""

import importlib
import warnings

import pytest

MOVED = [
    ("slipcache.training.trainer", "Run", "slipcache.training.run"),
    ("slipcache.training.trainer", "Progress", "slipcache.training.run"),
    ("slipcache.training.trainer", "build_model", "slipcache.training.backend"),
    ("slipcache.training.trainer", "make_config", "slipcache.training.config"),
    ("slipcache.data.dataset", "Batch", "slipcache.data.batches"),
    ("slipcache.data.dataset", "BatchIterator", "slipcache.data.batches"),
    ("slipcache.data.dataset", "SampleFilter", "slipcache.data.batches"),
    ("slipcache.staleness.detector", "RULES", "slipcache.staleness.config"),
    ("slipcache.staleness.detector", "GuardDecision", "slipcache.staleness.guard"),
    ("slipcache.staleness.detector", "HotIndex", "slipcache.staleness.hotset"),
    ("slipcache.staleness.detector", "SkipGuard", "slipcache.staleness.guard"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_an_old_path_warns_once_and_gives_the_same_object(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    assert name not in vars(module)  # every use goes through the warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = getattr(module, name)
        again = getattr(module, name)
    assert first is again is getattr(importlib.import_module(new), name)
    # Once per process: an earlier test may already have used the old path.
    assert len(caught) <= 1
    assert all(issubclass(w.category, DeprecationWarning) and f"{new}.{name}" in str(w.message) for w in caught)


def test_the_first_use_warns() -> None:
    from slipcache._moved import moved_names

    attribute = moved_names("old.home", {"Thing": "slipcache.data.batches.Batch"})
    with pytest.warns(DeprecationWarning, match=r"old\.home\.Thing moved to slipcache\.data\.batches\.Batch"):
        attribute("Thing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attribute("Thing")  # the second use is silent
    with pytest.raises(AttributeError, match="no attribute 'Other'"):
        attribute("Other")
