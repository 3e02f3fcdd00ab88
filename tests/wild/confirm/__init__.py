"""Standalone confirmations of what specaudit found in the wild adapters: torch and transformers only."""
