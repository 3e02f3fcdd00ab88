"""Adapters that put other people's speculative decoders under the harness.

- `hf_assisted.HFAssisted`: Hugging Face assisted generation (`generate(assistant_model=...)`),
  batch size 1 looped over rows, under the decoder contract: every check applies.
- `blackbox`: engines that own their models (token prompts in, tokens out), e.g. a vLLM
  `LLM`; only equivalence with the batch-size-1 oracle can be checked (docs/vllm_example.md).
- `transports` and `engine_blackbox`: continuous-batching engines that own their models (an
  OpenAI-compatible server on localhost, a step-wise engine or a `generate` callable), with
  staggered arrivals (`transports`), judged against the oracle (`engine_blackbox`); output-level
  evidence only.
"""

from specaudit.adapters.blackbox import BlackBoxEngine, BlackBoxResult, DecoderEngine, audit_blackbox
from specaudit.adapters.engine_blackbox import EngineAuditResult
from specaudit.adapters.hf_assisted import HFAssisted, UnsupportedModelError
from specaudit.adapters.transports import audit_callable, audit_server

__all__ = [
    "BlackBoxEngine",
    "BlackBoxResult",
    "DecoderEngine",
    "EngineAuditResult",
    "HFAssisted",
    "UnsupportedModelError",
    "audit_blackbox",
    "audit_callable",
    "audit_server",
]
