"""Benchmarks: the machinery behind scripts/bench_*.py (ratios measured side by side in one run)."""
