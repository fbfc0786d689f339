"""fedadapt's method-agnostic ClientApp, its offline tasks (data + models)."""
