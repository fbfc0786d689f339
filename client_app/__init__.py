"""fedadapt's method-agnostic ClientApp (the tasks it trains live in ``app_common``)."""
