"""Tools around runs: compare runs, generate the config tables, convert data, measure curves and factors."""
