"""Benchmark harnesses: `quality.py` (PPL / ROUGE-L vs budget) and `speed.py` (throughput, latency, memory).

Both are plain scripts (`python benchmarks/quality.py --help`); this package lets the tests import them.
"""
