"""Example: an existing legacy (NumPyClient + ServerApp(server_fn=…)) Flower app that plugs in fedadapt."""
