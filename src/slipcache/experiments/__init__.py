"""Benchmarks and the experiments that answer the papers' questions, with the machine probes they report."""
