"""Artifacts: reproducers, the audit and its report, the gate's JUnit, transplants to CPU reproducers."""
