"""What both fedadapt apps share: the run-wide settings (``config``), the round-config keys they exchange (``wire``)
and the tasks (data + models: ``task`` and the modules it loads), which the clients train and the server evaluates."""
