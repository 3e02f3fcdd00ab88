"""Search and minimization: Hypothesis strategies, the search for a failing case, delta
debugging and the engine state machine."""
