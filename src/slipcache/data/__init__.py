"""Criteo readers, preprocessing, the binary dataset format, synthetic data and batch iteration."""
