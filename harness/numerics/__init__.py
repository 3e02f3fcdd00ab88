"""Numerics: per-dtype tolerances, the measured noise floor and the higher-precision witness."""
