"""Old import paths of names that moved: each still resolves, with one DeprecationWarning, for one release."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_names(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` serving `moved` (old name -> "new.module.name"); it warns once per name.

    The names stay out of the old module's globals, so every use goes through here and none is silent.
    """
    warned: set[str] = set()

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, _, attribute = target.rpartition(".")
        value = getattr(importlib.import_module(new_module), attribute)
        if name not in warned:
            warned.add(name)
            warnings.warn(f"{module}.{name} moved to {target}; the old name will be removed in the next release",
                          DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
