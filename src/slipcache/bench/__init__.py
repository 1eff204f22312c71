"""`slipcache bench`: the embedding, cache and training benchmarks, and the machine probes they report."""
