"""The contracts: what a case, a decoder, an engine, a violation and a rule are.

The foundation layer, torch-free where the plugin loads it at start-up.
"""
