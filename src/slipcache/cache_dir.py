"""The one directory slipcache writes to besides those a user names: generated and converted data and
compiled loops are kept there so that runs share them (`$SLIPCACHE_CACHE_DIR`, else ~/.cache/slipcache)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    """`$SLIPCACHE_CACHE_DIR` when set (tests and shared machines point it elsewhere), else ~/.cache/slipcache."""
    env = os.environ.get("SLIPCACHE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "slipcache"
