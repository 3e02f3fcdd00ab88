"""Public batched speculative decoders transcribed as specaudit sampling decoders ("in the wild")."""
