"""fedadapt's method-agnostic ServerApp: run-config → strategy, central evaluation, metrics, final model."""
