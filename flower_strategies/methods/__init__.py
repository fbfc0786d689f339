"""The server half of every built-in method (strategy classes), registered by the registry
(:mod:`flower_strategies.core.registry`, which imports this package); the client halves are
:mod:`flower_strategies.optimizers`."""
