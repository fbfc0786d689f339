"""Launchers (Ray simulation, local deployment), in-process engines, paper reproductions, benchmarks and tools."""
