"""Artifacts, formats only: the reproducer envelope, report.json, JUnit XML and the tables rendered from report entries.

Nothing here runs a model, a search or an engine (tests/test_layers.py holds it to that); what
runs an audit and writes these is `specaudit.audits`.
"""
