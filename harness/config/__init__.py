"""Settings: one frozen dataclass per command, the known-failures file, specaudit's Hypothesis profiles."""
