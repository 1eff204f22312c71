"""slipcache: mixed-precision cached embeddings and stale-input skipping for recommendation training."""

__version__ = "0.1.0"
