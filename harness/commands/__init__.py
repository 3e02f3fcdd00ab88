"""Commands: the CLI, replay, minimize, the installed suite and the pytest plugin."""
