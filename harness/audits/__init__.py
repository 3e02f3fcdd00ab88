"""What runs an audit: the plan, the subject drivers, the worker pool, the verdicts, the outputs.

- `plan`: the items of an audit or a gate and `SUBJECTS`, one `SubjectDriver` per kind of subject
  (decoders on the built-in models, engines through the state machine); a new kind, such as a
  paged engine, is one more driver there.
- `verdict`: the one `Verdict` protocol every kind's verdict keeps (passed, as expected, report
  entry, table details, reproducers), per-check statuses over runs, the progress lines.
- `decoders`, `engines`: each kind's driver, verdict and plan.
- `audit`, `gate`: `specaudit audit` and `specaudit gate` (its thresholds and JUnit testcases).
- `realaudit`, `transplant`: real-model mode, and a real batch moved onto the exact CPU models.
- `regression`: the regression tests written beside a reproducer.

Formats (the reproducer envelope, report.json, JUnit, the tables) are `specaudit.artifacts`;
this layer sits above the adapters and below the commands.
"""
