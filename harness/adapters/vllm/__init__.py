"""vLLM as a subject of `specaudit audit-vllm`, at both levels: a served vLLM's outputs (the black
box) and an in-process engine's every target forward (the white box).

| module | concern |
|---|---|
| `models` | the served models: a config-built tiny Llama and its layer-skip draft, SmolLM2 and its draft |
| `server` | per configuration, the server's arguments (black box) and `EngineOptions` (white box) |
| `lifecycle` | a server's process: started in its own group, waited on /health, stopped on every exit |
| `metrics` | the server's speculative counters, read from /metrics |
| `drafts` | drafts shaped on purpose (fewer than K, a share wrong): a vLLM general plugin |
| `observer` | `VllmObserver`: every target forward's paged layout, recorded in process |
| `whitebox` | drawn workloads through an in-process engine, judged by the paged rules and outputs |
| `report` | the audit's report: an entry per level per configuration |

The planted bugs are `specaudit.reference.vllm_mutants`; the commands are
`specaudit.commands.audit_vllm` and `whitebox_vllm`. Nothing is imported here: vLLM's engine core
imports `drafts` as a plugin, and the main venv imports `lifecycle` and `report` without vLLM.
Absolute imports (`from vllm import LLM`) inside this package reach the vLLM library, never it.
"""
