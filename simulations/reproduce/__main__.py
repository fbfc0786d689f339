"""``python -m simulations.reproduce``: see :mod:`simulations.reproduce.cli`."""

from .cli import main

raise SystemExit(main())
