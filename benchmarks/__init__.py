"""Research studies over slipcache (not installed): each runs a grid of training runs and writes raw
results.json beside a generated report. Run one with `python -m benchmarks.studies STUDY --out DIR` from the
repository root; `python -m benchmarks.results` regenerates docs/results.md from the committed JSON."""
