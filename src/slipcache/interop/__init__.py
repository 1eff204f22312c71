"""Bridges to other libraries (optional dependencies, imported lazily)."""
