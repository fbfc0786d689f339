"""The in-process engines: the real Strategy drives the real ClientApp without Ray or a SuperLink."""
