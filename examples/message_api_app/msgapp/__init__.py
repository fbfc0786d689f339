"""Example: an existing Message-API Flower app that plugs in fedadapt (see ../README.md)."""
