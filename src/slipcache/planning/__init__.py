"""Memory planning from an id profile: `slipcache plan` (per-table precision and cache, placement preview)."""
