"""Benchmarks: each `python -m simulations.bench.<name>` measures one cost and prints its table."""
