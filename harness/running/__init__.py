"""Running and observing: the oracle and the decoder under test on instrumented models, and engine sessions."""
