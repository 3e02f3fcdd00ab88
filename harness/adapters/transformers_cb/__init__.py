"""transformers' continuous batching as a paged engine: every target forward recorded, every
request judged, through each of its public entry points.

transformers (5.x) serves requests by continuous batching: a background thread packs the
scheduled requests' tokens into one flat batch and keeps K/V in pages. That is the layout
`specaudit.checks.paged` judges, so this package records it as the same evidence vLLM's
observer records (`running.paged.PagedCall`, `PagedTrace`) and judges it through the same
registry entry (`checks.registry.PAGED`). Neither engine's adapter imports the other's.

| module | concern |
|---|---|
| `workload` | `CbRequest`, `CbWorkload`, their JSON, the fixed smoke and planted-bug workloads |
| `models` | the engine's and the oracle's tiny Llama, likely tokens |
| `layout` | a forward's keyword arguments and the allocator -> `PagedCall` fields (`packed`, `Layout`) |
| `observer` | `CbObserver`: the hooks, commits, departures, preemption as a new incarnation |
| `schedule`, `driver` | CB settings; `run_workload` via `generate_batch`, the manager or `generate(paged)` |
| `verdict` | `CbVerdict`, `verdict_of` = `evaluate(PAGED, PagedRun(...))` |
| `defects` | `KNOWN_DEFECTS` of transformers' own `generate(cache_implementation="paged")` |
| `strategies` | `cb_workloads`, the Hypothesis strategy |
| `exercised`, `report` | coverage and preemptions; report entries of kind "paged engine" |
| `hypothesis_search` | `search`: Hypothesis over `cb_workloads`, a new failure shrunk |
| `reproducer` | a failure written as a paged-engine reproducer; `replay_workload` runs it again |

The planted bugs are `specaudit.reference.transformers_cb_mutants`; `make audit` runs this engine
through `specaudit.audits.transformers_cb`.
"""

from specaudit.adapters.transformers_cb.defects import KNOWN_DEFECTS, KnownDefect, known_defects
from specaudit.adapters.transformers_cb.driver import CbRun, cb_config, generation_config, run_workload
from specaudit.adapters.transformers_cb.exercised import coverage, preemptions
from specaudit.adapters.transformers_cb.hypothesis_search import Search, search
from specaudit.adapters.transformers_cb.layout import Layout, packed
from specaudit.adapters.transformers_cb.models import continuation, engine_model, likely_tokens, oracle_model
from specaudit.adapters.transformers_cb.observer import CbObserver
from specaudit.adapters.transformers_cb.report import report_entry, search_entry
from specaudit.adapters.transformers_cb.reproducer import read_workload, replay_json, replay_workload, write_reproducer
from specaudit.adapters.transformers_cb.strategies import cb_workloads
from specaudit.adapters.transformers_cb.verdict import (
    CbVerdict,
    kv_reference,
    output_record,
    transport_errors,
    verdict_of,
)
from specaudit.adapters.transformers_cb.workload import (
    ENGINE,
    ENTRY_POINTS,
    MUTANT_WORKLOADS,
    SMOKE,
    CbRequest,
    CbWorkload,
    mutant_workload,
    workload_from_json,
    workload_json,
)

__all__ = [
    "ENGINE",
    "ENTRY_POINTS",
    "KNOWN_DEFECTS",
    "MUTANT_WORKLOADS",
    "SMOKE",
    "CbObserver",
    "CbRequest",
    "CbRun",
    "CbVerdict",
    "CbWorkload",
    "KnownDefect",
    "Layout",
    "Search",
    "cb_config",
    "cb_workloads",
    "continuation",
    "coverage",
    "engine_model",
    "generation_config",
    "known_defects",
    "kv_reference",
    "likely_tokens",
    "mutant_workload",
    "oracle_model",
    "output_record",
    "packed",
    "preemptions",
    "read_workload",
    "replay_json",
    "replay_workload",
    "report_entry",
    "run_workload",
    "search",
    "search_entry",
    "transport_errors",
    "verdict_of",
    "workload_from_json",
    "workload_json",
    "write_reproducer",
]
