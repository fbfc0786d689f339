"""Launchers (Ray simulation, local deployment), the in-process engine, presets and benchmarks."""
