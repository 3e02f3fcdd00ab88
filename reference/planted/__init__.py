"""The planted bugs, one module per family; `specaudit.reference.mutants` is their catalog.

Import them through `specaudit.reference.mutants` (its `CATALOG`, and `--decoder
specaudit.reference.mutants:NAME`); the modules here only group their source by what the harness must catch.
"""
