"""Stops, limits and request order where speculation makes them hard: an accepted run that
crosses both a stop token and `max_tokens`, and a step whose requests carry different draft
counts. Each planted vLLM bug of those classes (`reference.vllm_mutants`, workload `STOPS`) is
caught by the white box's judgement (every paged rule, the output contract, equivalence with the
batch-size-1 oracle) with the check and rule the catalog names; unpatched vLLM passes the same
workloads. Runs vLLM in a fresh process each (one engine per process); needs the vLLM venv.

Stop strings and usage counts live in vLLM's front end (its detokenizer, its completions API),
which only a served vLLM runs: the served test starts the OpenAI-compatible server drafting for
itself, unpatched and with each planted front-end bug (`SERVED_MUTANTS`), and runs the black box
(`transports.audit_server`) with a stop string on every request.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (run under .venv-vllm/bin/pytest)")

SCRIPT = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from specaudit.adapters.vllm.drafts import DraftShape, drafts_shaped
from specaudit.adapters.vllm.observer import build_llm
from specaudit.adapters.vllm.whitebox import (EngineOptions, PlannedRequest, Workload, load_target, oracle_from,
                                              output_record, paged_violations, run_workload)
from specaudit.reference.oracle import greedy_oracle
from specaudit.reference.vllm_mutants import BY_NAME, plant
from specaudit.running.paged import PagedRun
OUTPUT_LEVEL = ("contract", "equivalence", "liveness")  # what the black box judges too: outputs alone
model, mutant = sys.argv[1], sys.argv[2]
if mutant:
    plant(BY_NAME[mutant])
options = EngineOptions("self-draft", 5, 32, None, None, False, 128)
llm = build_llm(model, options.speculative(model, None), **options.engine_args())
target = load_target(model)
prompts = [tuple(range(10 + 7 * i, 40 + 7 * i)) for i in range(3)]

def judged(name, workload, shape):
    with drafts_shaped(shape):
        observed = run_workload(llm, workload)
    run = PagedRun(observed.trace, record=output_record(observed, workload, target), dtype="float32",
                   oracle_from=oracle_from(target, workload.eos))
    found = paged_violations(run)
    first = f"{found[0].check}/{found[0].rule}" if found else "-"
    seen = int(any(v.check in OUTPUT_LEVEL for v in found))
    return observed, first, seen

# a stop token first emitted at index j of r0's output, max_tokens j + 2: one accepted run (indices 1..6) holds both
oracle = greedy_oracle(target, prompts[0], max_new_tokens=8, eos_token_id=None).tokens
j = next(j for j in (3, 2, 4) if oracle[j] not in oracle[:j])
limit = Workload((PlannedRequest(prompts[0], 0, j + 2), PlannedRequest(prompts[1], 0, 12)), eos=oracle[j])
observed, first, seen = judged("limit", limit, DraftShape())
ended = observed.outputs["r0"][-1] == oracle[j] and len(observed.outputs["r0"]) <= j + 2
print("CASE limit", first, seen, int(ended), flush=True)

order = Workload(tuple(PlannedRequest(p, 0, 20) for p in prompts))
observed, first, seen = judged("order", order, DraftShape(ragged=True))
ragged = 0
for call in observed.trace.calls:
    counts = {call.span(b)[1] - call.span(b)[0] - 1 for b in range(len(call.request_ids)) if call.past(b) > 0}
    ragged += len(counts - {0}) > 1
print("CASE order", first, seen, int(ragged > 0), flush=True)
"""


def cases(model: Path, mutant: str | None) -> dict[str, list[str]]:
    """Each fixed workload's first violation (check/rule or -), whether an output-level check (the
    contract, equivalence, liveness: what the black box judges too) saw it, and whether the workload
    exercised what it is for (r0 ending at its stop inside a run; a step of ragged draft counts)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model), mutant or ""], capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    found = {line.split()[1]: line.split()[2:] for line in done.stdout.splitlines() if line.startswith("CASE")}
    assert len(found) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The black box's served tiny Llama (`adapters.vllm.models`): its draft agrees often, not always."""
    from specaudit.adapters.vllm.models import tiny_llama

    out = tmp_path_factory.mktemp("vllm_stops") / "target"
    tiny_llama(out)
    return out


@needs_vllm
def test_unpatched_vllm_ends_runs_at_stops_and_keeps_request_order(model: Path) -> None:
    """The stop token inside an accepted run that also reaches max_tokens ends the request there
    (on stop); requests verifying different draft counts in one step each get their own tokens."""
    found = cases(model, None)
    assert found["limit"] == ["-", "0", "1"], found
    assert found["order"] == ["-", "0", "1"], found


def stop_mutants() -> list[Any]:
    from specaudit.reference.vllm_mutants import MUTANTS, STOPS

    return [pytest.param(m, id=m.name) for m in MUTANTS if m.workload == STOPS]


@needs_vllm
@pytest.mark.parametrize("mutant", stop_mutants())
def test_planted_stop_and_order_bugs_are_caught_with_their_rule(model: Path, mutant: Any) -> None:
    """Each planted bug fails its workload with the catalog's check and rule first, and the output
    level (the checks the black box runs too) sees it exactly when the catalog says so."""
    found = cases(model, mutant.name)
    which = "limit" if mutant.rule == "ends-at-eos" else "order"
    first, seen, _ = found[which]
    assert first == f"{mutant.check}/{mutant.rule}" and found["order"][2] == "1", found
    assert seen == str(int(mutant.output_visible)), found


SERVED_PROMPTS, SERVED_LIMIT = 8, 24


def served_mutants() -> list[Any]:
    from specaudit.reference.vllm_mutants import SERVED_MUTANTS

    return [pytest.param(None, id="unpatched"), *(pytest.param(m, id=m.name) for m in SERVED_MUTANTS)]


@needs_vllm
@pytest.mark.parametrize("mutant", served_mutants())
def test_planted_stop_and_order_bugs_of_the_served_front_end(model: Path, tmp_path: Path, mutant: Any) -> None:
    """A served vLLM drafting for itself (every draft accepted: runs of 6 tokens carry a stop string's
    completion with tokens after it), every request with a stop string drawn from its oracle's text:
    unpatched, the black box passes; each planted front-end bug fails it with the catalog's rule only."""
    from specaudit.adapters.transports import audit_server
    from specaudit.adapters.vllm.lifecycle import SERVER_ENV, free_port, server_command, serving
    from specaudit.adapters.vllm.server import SELF_DRAFT_TOKENS, boundary_prompts, server_block, workaround_env
    from specaudit.reference.vllm_mutants import PLANT_ENV

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": SELF_DRAFT_TOKENS}
    command = server_command(sys.executable, model, port, spec) + list(server_block("tiny"))
    env = {**SERVER_ENV, **workaround_env(), PLANT_ENV: mutant.name if mutant else ""}
    with serving(command, url, tmp_path / "server.log", 900.0, env):
        result = audit_server(url, str(model), boundary_prompts(512, SERVED_PROMPTS, 0), max_new_tokens=SERVED_LIMIT,
                              seed=0, spread_s=0.3, model=str(model), dtype="float32", stop_share=1.0)  # fmt: skip
    stopped = [o for o in result.outcomes if o.request.stop is not None]
    assert len(stopped) >= SERVED_PROMPTS - 1, result.render()
    if mutant is None:
        assert result.passed, result.render()
        assert all(len(o.tokens or ()) < SERVED_LIMIT for o in stopped), result.render()
        return
    assert not result.passed and {v.rule for v in result.violations} == {mutant.rule}, result.render()
