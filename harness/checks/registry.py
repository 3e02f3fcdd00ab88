"""The one list of checks: what each asserts, which subjects it judges and through which
implementation, in which order, when it applies, its rules and cache slots, and how its first
violation maps to the paper's failure signature.

Every subject's judge dispatches through it: `evaluate(subject, evidence)` runs, in order, each
check's implementation for that subject (a decoder run, an engine step, a black box's answers, a
paged engine's run). The properties (one per decoder check), `audit`, `gate`, `minimize`, the
diagnosis, the JUnit output and docs/checks.md's table read the same list. A check that cannot
judge the evidence (token preservation without the scripted draft, a wait bound the decoder does
not declare, order independence of a single row, a paged engine's outputs that were not
recorded) is "not applicable" for it, never a pass. A contract break short-circuits: nothing
else is judged on such evidence. The registry is checked when it is imported (`validate`): a
subject with no callable implementation is an import error, never a KeyError during a run.

Signatures (paper, sections 4.2 and 6):
  position-id        wrong position ids or misaligned batches (a row's logits read at a pad
                     column); diverges at the first ragged round, low exact and low partial match;
  kv-drift           stale, rejected or pad entries attended in a batch of >= 2 rows; high
                     partial, low exact match;
  bonus              wrong even at batch size 1: a batch-independent error (a wrong bonus or
                     acceptance, rejected entries kept; the paper's appendix A), so a minimal
                     case of one row is never kv-drift;
  numerical-tie      only divergences within the noise (real models: the measured noise floor,
                     judged by a higher-precision witness; built-in models: the oracle's margin
                     against the dtype's rounding tolerance); the run passes, equivalent modulo numerics;
  output-equivalent  output right, but an invariant or token preservation is broken;
  bookkeeping        output-level errors without a broken invariant (EOS, length, row order, a
                     token the cache holds verified but the output lost);
  scheduling         output right, but a scheduler rule is broken (a request waits past the
                     declared bound, a grouped batch is realigned, the output depends on pool order);
  contract           the decoder broke the decoder contract, or never called the target;
  batch-only         output level only (a black box, whose forwards are not seen): wrong in the
                     batch, right when the prompt runs alone, so a batch-dependent error
                     (position-id, kv-drift or bookkeeping) that the outputs cannot tell apart;
  sampling           a sampling decoder's tokens are not the target's own samples: a role's
                     tokens off the target's distribution, a token it cannot draw, or rows of a
                     batch that are not independent.

A signature is decided from the minimal case's evidence (`decided`, `equivalence_signature`):
with no target call it is contract (nothing was attended, so never kv-drift or position-id); on
a case of one row there is no batch to drift across, so kv-drift there is bonus; a wrong token
is re-run alone: wrong alone too is bonus, right alone and read at a pad column of the call
that decided it is position-id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from specaudit.checks import (
    check_contract,
    check_equivalence,
    check_i1,
    check_i2,
    check_token_preservation,
    equivalence,
)
from specaudit.checks.distribution import check_distribution
from specaudit.checks.engine_step import step_contract, step_equivalence, step_i1, step_i2, step_liveness
from specaudit.checks.equivalence import pad_columns_read
from specaudit.checks.independence import check_row_independence, has_pairs
from specaudit.checks.outputs import OutputEvidence, record_contract, record_equivalence, record_liveness
from specaudit.checks.paged import check_paged
from specaudit.checks.scheduling import (
    check_grouped_no_realignment,
    check_liveness,
    declared_bound,
    grouped_pairs,
    order_independence,
)
from specaudit.contracts.builtins import MODELS
from specaudit.contracts.case import Case
from specaudit.contracts.rules import CHECK_RULES, CONTRACT_RULES, PAGED_RULES
from specaudit.contracts.subjects import EVIDENCE
from specaudit.contracts.violation import Violation
from specaudit.running.paged import PagedRun
from specaudit.running.runner import Run
from specaudit.running.sampling import SampledRun

SIGNATURES = (
    "position-id",
    "kv-drift",
    "bonus",
    "numerical-tie",
    "output-equivalent",
    "bookkeeping",
    "scheduling",
    "contract",
    "batch-only",
    "sampling",
)
SAMPLING_SIGNATURES = ("sampling",)
"""Given to a sampling decoder's tokens (`sampling_signature`), which a greedy diagnosis never sees."""
OUTPUT_LEVEL_SIGNATURES = ("batch-only",)
"""Given only where the forwards are not seen (`adapters.blackbox.audit_blackbox`); a decoder's or
an engine's diagnosis names the cause instead."""

PASS, FAIL, NOT_APPLICABLE = "pass", "fail", "not applicable"

Signature = tuple[str, str]  # (signature, reason)

SUBJECTS = EVIDENCE
DECODER, ENGINE, BLACK_BOX, PAGED, SAMPLER = SUBJECTS
"""Who a check can judge, and the evidence its implementation for that subject reads (the
`evidence` of each kind of subject in `contracts.subjects.KINDS`, which several kinds share):

  decoder       a batch decoder's run on the built-in or real models (`running.runner.Run`)
  engine        a white-box engine session after every step (`checks.engine_step.EngineStep`,
                made by `checks.engine.EngineJudge`)
  black box     a black box's answers at the output level (`checks.outputs.OutputEvidence`, made by
                `adapters.engine_blackbox.judge_answers` and `adapters.blackbox.audit_blackbox`)
  paged engine  a paged engine's forwards and outputs (`running.paged.PagedRun`: vLLM in process,
                transformers' continuous batching)
  sampling decoder
                a sampling decoder's seeded runs of one case (`running.sampling.SampledRun`): each
                run judged as a decoder's by the per-run checks, the runs pooled by the others

All but the decoder's read each request's outputs from a `running.record.Record`."""


class RegistryError(AssertionError):
    """The registry does not hold together (raised at import): a subject without a callable
    implementation, an unknown subject, a requirement for a subject the check does not judge."""


# ---------------------------------------------------------------------------------------
# When a check applies


@dataclass(frozen=True)
class Requirement:
    """Something one subject's evidence must offer for a check to judge it (a decoder's run by
    default); `reason` says what is missing."""

    reason: str
    holds: Callable[[Any], bool]  # the subject's evidence -> whether it offers what the check needs
    of_decoder: bool = False  # the decoder lacks it (every run alike), not this one case
    subject: str = DECODER  # whose evidence it reads (see SUBJECTS)


SCRIPTED_DRAFT = Requirement("needs the scripted draft", lambda run: run.case.draft == "scripted")
DECLARED_BOUND = Requirement(
    "the decoder declares no max_wait_calls", lambda run: declared_bound(run) is not None, of_decoder=True
)
EVERY_CALL_SEEN = Requirement(
    "target calls were sampled out, so waits cannot be counted",
    lambda run: all(c.sampled for c in run.recording.target_calls),
)
A_BATCH = Requirement("needs a batch of >= 2 rows", lambda run: run.case.batch_size >= 2)
A_TARGET_CALL = Requirement("no target call was observed (I1 says why)", lambda run: bool(run.recording.target_calls))
BUILT_IN_MODEL = Requirement(
    "an external-model batch is not re-run in another order (judged on the built-in models)",
    lambda run: run.case.model in MODELS,
)


GROUPED_PAIR = Requirement(
    "no request takes part in two grouped (pad-free) target calls in a row", lambda run: bool(grouped_pairs(run))
)
PAIRED_ROWS = Requirement("needs two rows of one prompt", has_pairs, subject=SAMPLER)
REQUESTS_RECORDED = Requirement(
    "the outputs were not recorded (a trace alone): only the paged layout is judged",
    lambda run: run.record is not None,
    subject=PAGED,
)


# ---------------------------------------------------------------------------------------
# Signatures: a check's first violation -> (signature, reason), read from fields only


def contract_signature(first: Violation, run: Run) -> Signature:
    return "contract", first.rule


def i1_signature(first: Violation, run: Run | None = None) -> Signature:
    if first.rule == "target-called":
        return "contract", "the target was never called, so nothing the decoder returned was verified (target-called)"
    if first.rule == "position-shape":
        return "position-id", f"position ids do not fit the batch ({first.rule})"
    return "kv-drift", f"the mask or cache does not fit the batch, so other slots are attended ({first.rule})"


def i2_signature(first: Violation, run: Run | None = None) -> Signature:
    """From the I2 evidence: an extra slot before the row's own (a lower position than the one
    due) or another token is KV drift; the right token at another position is a position error."""
    if first.rule == "position-ids":
        return "position-id", "a current input is fed at the wrong position"
    found_token, found_position = first.evidence.get("found_token"), first.evidence.get("found_position")
    want_token, want_position = first.evidence.get("expected_token"), first.evidence.get("expected_position")
    if None not in (found_position, want_position) and found_position < want_position:
        return "kv-drift", "an extra slot (stale, rejected or pad) is attended among the row's own"
    if found_token is not None and found_token == want_token and found_position != want_position:
        return "position-id", "the right token sits at the wrong position"
    return "kv-drift", "a slot holding another token (stale, rejected or pad) is attended"


def single_row(case: Case, row: int) -> Case:
    """Row `row` of the case alone, without extra pad columns."""
    return replace(case, prompts=(case.prompts[row],), accept=(case.accept[row],), extra_pad_columns=0)


def equivalence_signature(first: Violation, run: Run) -> Signature:
    """A wrong stop, or a wrong token where the cache holds the oracle's, is bookkeeping; dropped
    verified KV is drift; else re-run the row alone: an invariant broken there names it, a wrong
    token there is a bonus error; right alone, a row read at a pad column is a position error
    (a misaligned batch), else bookkeeping."""
    row = first.request if first.request is not None else 0
    found = equivalence(run).rows[row]
    if found.found[: len(found.reference)] == found.reference[: len(found.found)]:
        return "bookkeeping", f"row {row} stops at the wrong place ({found.found_stop} vs {found.expected_stop})"
    held, want = first.evidence.get("cache_token"), first.evidence.get("expected_token")
    if held is not None and held == want:
        return "bookkeeping", (
            f"row {row}'s output has token {first.evidence.get('found_token')} at index {first.evidence.get('index')} "
            f"where its cache holds the oracle's token {held}: the output lost a token the target verified"
        )
    if any(v.rule == "verified-kept" for v in outcome_of("token-preservation", run).violations):
        return "kv-drift", "verified tokens' KV was dropped from the cache and the output went wrong"
    alone = run.again(single_row(run.case, row))
    seen = evaluate(alone).first_failure
    wrong = alone.outputs is not None and outcome_of("equivalence", alone).status == FAIL
    pads = pad_columns_read(run, first) if seen is None and not wrong else None
    if pads is not None:
        return "position-id", (
            f"row {row} is right alone, and target call {first.call}, which decided its wrong token, ends its batch "
            f"row {pads[0]} in {pads[1]} pad column(s): its logits were read at a pad column, not its last token"
        )
    return alone_signature(row, seen.violations[0] if seen is not None else None, wrong, alone)


def alone_signature(row: int, first_alone: Violation | None, wrong_alone: bool, alone: Run | None = None) -> Signature:
    """A wrong output's signature from its row (or engine request) re-run alone: an invariant
    broken there names it, a wrong token there is a bonus error, none is bookkeeping."""
    if first_alone is not None and check_named(first_alone.check).per_call:  # a sampled-out call hid it
        signature, why = decided(check_named(first_alone.check).signature(first_alone, alone), alone)
        return signature, f"{why}; seen when row {row} runs alone: {first_alone.render()}"
    if wrong_alone:
        return "bonus", "the wrong token appears even at batch size 1"
    return "bookkeeping", "the output goes wrong only in a batch, with every invariant intact"


def decided(signature: Signature, run: Run | None) -> Signature:
    """A check's signature held to the minimal case's evidence (None: an engine's, judged per
    step). No target call attended anything, so nothing drifted and no position was wrong: a
    contract break. One row has no batch to drift across: what it attends wrongly is a
    batch-independent error, wrong even at batch size 1 (the paper's appendix A puts rejected
    entries kept there, with a wrong bonus)."""
    name, why = signature
    if run is None or name not in ("kv-drift", "position-id"):
        return signature
    if not run.recording.target_calls:
        return "contract", f"the target was never called, so nothing was verified ({why})"
    if name == "kv-drift" and run.case.batch_size == 1:
        return "bonus", "wrong even at batch size 1 (one row: no batch to drift across); it attends slots not its own"
    return signature


def scheduling_signature(reason: str) -> Callable[[Violation, Run], Signature]:
    return lambda first, run: ("scheduling", reason)


def liveness_signature(first: Violation, run: Run | None) -> Signature:
    """Scheduling, in the subject's own unit (a decoder's target calls, an engine's steps)."""
    if first.rule == "request-finishes":
        return "scheduling", "a request never finished"
    return "scheduling", f"a request waited past its declared bound: {first.found}, wanted {first.expected}"


# ---------------------------------------------------------------------------------------
# A check: its implementation per subject, its signature, when it applies, its rules and caches


Implementation = Callable[[Any], list[Violation]]
"""A check's implementation for one subject: that subject's evidence -> its violations."""


@dataclass(frozen=True)
class Check:
    """One check of the registry; its place in CHECKS is the order violations are reported in.

    Everything a check is lives here: the subjects it judges are the keys of `implementations`
    (each the function that reads that subject's evidence), `rules` the rule names its violations
    carry (written as a literal, or a table of `contracts.rules`: that module reads them from this
    file's source, torch-free, to validate a known-failures file before torch is imported), and
    `caches` the slots it fills once per decoder run (`run.derived.cached[name]`, through
    `checks.cache.cached`). Its planted negative control names it in its `bug` record (the catalogs
    of `reference/` collect those; `tests/checks/test_registry.py` wants one per check)."""

    name: str
    title: str  # the property's name in docs/checks.md's table
    statement: str  # one sentence: the docs/checks.md row and the property's docstring
    implementations: Mapping[str, Implementation]  # subject -> its evidence -> violations
    signature: Callable[[Violation, Any], Signature]  # its first violation -> (signature, reason)
    needs: tuple[Requirement, ...] = ()  # per subject (`Requirement.subject`): when it is not applicable
    per_call: bool = False  # judged on every target call (an invariant), not on the run's output
    caches: tuple[str, ...] = ()  # its slots in `run.derived.cached[name]`
    rules: frozenset[str] = frozenset()  # the rule names its violations carry
    cost: bool = False  # judges a design's cost, not its correctness: its failure alone is an efficiency finding

    def __post_init__(self) -> None:
        unknown = sorted(set(self.implementations) - set(SUBJECTS))
        if not self.implementations or unknown:
            raise RegistryError(f"check {self.name}: subjects {unknown or '(none)'}; should be some of {SUBJECTS}")
        missing = [s for s, f in self.implementations.items() if not callable(f)]
        if missing:
            raise RegistryError(f"check {self.name} judges {missing} without an implementation (got no callable)")
        stray = [need.reason for need in self.needs if need.subject not in self.implementations]
        if stray:
            raise RegistryError(f"check {self.name}: requirements for subjects it does not judge: {stray}")
        if not self.rules:
            raise RegistryError(f"check {self.name} has no rules: name the rules its violations carry")

    @property
    def subjects(self) -> tuple[str, ...]:
        """What it judges (see SUBJECTS), in SUBJECTS' order."""
        return tuple(subject for subject in SUBJECTS if subject in self.implementations)

    def unmet(self, evidence: Any, subject: str = DECODER) -> Requirement | None:
        """The first requirement `evidence` of `subject` does not offer (None: the check applies)."""
        return next((need for need in self.needs if need.subject == subject and not need.holds(evidence)), None)

    def applies(self, evidence: Any, subject: str = DECODER) -> str | None:
        """None when the check judges `evidence` of `subject`, else why it is not applicable."""
        unmet = self.unmet(evidence, subject)
        return None if unmet is None else unmet.reason


PAGED_SIGNATURES = {
    "query-positions": "position-id",
    "greedy-commit": "bonus",
    "query-spans": "bookkeeping",
    "live-request": "bookkeeping",
    "draft-count": "bookkeeping",
}
"""The paged rules that are not KV drift (every other one: the wrong slots or stale K/V are read)."""


def paged_signature(first: Violation, trace: Any = None) -> Signature:
    signature = PAGED_SIGNATURES.get(first.rule, "kv-drift")
    return signature, f"the paged layout breaks {first.rule} ({first.found})"


# ---------------------------------------------------------------------------------------
# The checks


def liveness(run: Run) -> list[Violation]:
    return check_liveness(run, declared_bound(run))


def each_run(check: Callable[[Run], list[Violation]]) -> Implementation:
    """A decoder check on every run of a sampled case; a violation names its run (`evidence["run"]`)."""

    def judge(sampled: SampledRun) -> list[Violation]:
        return [
            replace(v, found=f"run {i}: {v.found}", evidence={**v.evidence, "run": i})
            for i, run in enumerate(sampled.runs)
            for v in check(run)
        ]

    return judge


def sampled_i2(run: Run) -> list[Violation]:
    """I2 on one run of a sampled case, but for a row holding exactly the history (or next token) of
    another request of its prompt: twins are told apart only by the tokens they sample, so a row
    bound to one twin that holds the other's history is a binding the content cannot settle; what
    it would cost (tokens drawn on the wrong history) is the distribution check's to see."""
    prompts = run.case.prompts

    def twins(v: Violation) -> bool:
        other = v.evidence.get("other_request")
        return None not in (v.request, other) and v.request != other and prompts[v.request] == prompts[other]

    return [v for v in check_i2(run) if not twins(v)]


def sampling_signature(first: Violation, sampled: Any = None) -> Signature:
    if first.rule == "rows-correlated":
        return "sampling", "rows of one batch are not independent samples (a batch bug)"
    if first.rule == "stops-early":
        return "bookkeeping", "a row stops before its limit without EOS"
    role = first.evidence.get("role") or first.evidence.get("token_role", "sampled")
    return "sampling", f"the {role} tokens are not distributed as the target's ({first.rule})"


def paged_layout(run: PagedRun) -> list[Violation]:
    """The paged rules on every forward of the trace (kv-entry with the batch-size-1 `reference`)."""
    return check_paged(run.trace, run.reference)


def paged_outputs(run: PagedRun) -> OutputEvidence:
    """A paged engine's record as output-level evidence (REQUESTS_RECORDED holds: a record)."""
    assert run.record is not None
    return OutputEvidence(run.record, run.dtype, run.oracle_from, dict(run.errors))


def paged_contract(run: PagedRun) -> list[Violation]:
    return record_contract(paged_outputs(run))


def paged_equivalence(run: PagedRun) -> list[Violation]:
    return record_equivalence(paged_outputs(run))


def paged_liveness(run: PagedRun) -> list[Violation]:
    return record_liveness(paged_outputs(run))


CHECKS: tuple[Check, ...] = (
    Check(
        "contract",
        "decoder contract",
        "the decoder returns one list of new token ids per row, in row order, ending at the first EOS or at "
        "`max_new_tokens`, without raising and without hanging (the watchdog's idle limit)",
        {
            DECODER: check_contract,
            ENGINE: step_contract,
            BLACK_BOX: record_contract,
            PAGED: paged_contract,
            SAMPLER: each_run(check_contract),
        },
        contract_signature,
        needs=(REQUESTS_RECORDED,),
        rules=CONTRACT_RULES,
    ),
    Check(
        "I1",
        "I1 rectangular alignment",
        "every target call: `input_ids` `[B, T]`, mask `[B, P + T]` with `P` the cache length of every layer, "
        "positions `[B, T]`, no row with a real input attending nothing (an all-pad row may)",
        {DECODER: check_i1, ENGINE: step_i1, SAMPLER: each_run(check_i1)},
        i1_signature,
        per_call=True,
        rules=frozenset(
            {
                "input-shape",
                "cache-length",
                "cache-batch",
                "position-shape",
                "mask-shape",
                "mask-values",
                "row-attends-nothing",
                "target-called",
            }
        ),
    ),
    Check(
        "I2",
        "I2 position/KV correspondence",
        "per row of every target call, the attended slots hold the row's prompt and verified tokens at positions "
        "0, 1, 2, ... and the current inputs continue the positions (a call without a cache re-feeds exactly the "
        "committed history); masked slots may hold anything (transparent models are read exactly, tiny real models "
        "against a batch-size-1 run's K/V)",
        {DECODER: check_i2, ENGINE: step_i2, SAMPLER: each_run(sampled_i2)},
        i2_signature,
        needs=(A_TARGET_CALL,),
        per_call=True,
        caches=("rows", "views"),
        rules=frozenset(
            {
                "attends-wrong-slot",
                "row-identity",
                "position-ids",
                "input-token",
                "cache-readable",
                "history-token",
                "retired-row",
                "duplicate-row",
            }
        ),
    ),
    Check(
        "paged",
        "paged layout",
        "every target forward of a paged engine (vLLM in process, transformers' continuous batching): the query "
        "spans partition the packed tokens, each request's context length is its committed tokens plus its query, "
        "its positions continue its committed length, each token is written at "
        "`block_table[pos // block_size] * block_size + pos % block_size` of its own request, no block is written "
        "by two live requests, and every attended slot holds that request's own K/V",
        {PAGED: paged_layout},
        paged_signature,
        per_call=True,
        rules=frozenset(PAGED_RULES),
    ),
    Check(
        "equivalence",
        "output equivalence",
        "every row equals the batch-size-1 greedy oracle: tokens, length, stop reason; a divergence within "
        "the noise is a numerical tie and the comparison re-syncs onto the decoder's token (real models: the "
        "two tokens' gap in a higher-precision score of the shared prefix against the measured noise floor; "
        "built-in models: the oracle's top-1/top-2 margin against the dtype's rounding tolerance)",
        {
            DECODER: check_equivalence,
            ENGINE: step_equivalence,
            BLACK_BOX: record_equivalence,
            PAGED: paged_equivalence,
        },
        equivalence_signature,
        needs=(REQUESTS_RECORDED,),
        caches=("equivalence",),
        rules=frozenset({"first-divergence", "beyond-precision-noise"}),
    ),
    Check(
        "token-preservation",
        "token preservation",
        "with the scripted draft, each round keeps exactly the drafts the schedule allows: none thrown away, "
        "none kept after rejection",
        {DECODER: check_token_preservation},
        lambda first, run: ("output-equivalent", "the output is right but drafts were lost or kept wrongly"),
        needs=(SCRIPTED_DRAFT,),
        rules=frozenset({"verified-kept", "accepted-as-scheduled"}),
        cost=True,
    ),
    Check(
        "liveness",
        "liveness",
        "every request finishes, and none waits more target calls than the decoder's declared `max_wait_calls`, "
        "counted from the start of `generate` to its first target call and between two of its calls",
        {
            DECODER: liveness,
            ENGINE: step_liveness,
            BLACK_BOX: record_liveness,
            PAGED: paged_liveness,
        },
        liveness_signature,
        needs=(DECLARED_BOUND, EVERY_CALL_SEEN, REQUESTS_RECORDED),
        rules=frozenset({"request-finishes", "bounded-queue", "bounded-wait"}),
    ),
    Check(
        "grouped-no-realignment",
        "grouped batches need no realignment",
        "between two grouped (pad-free) target calls of a request its cache slots stay where they were",
        {DECODER: check_grouped_no_realignment},
        scheduling_signature("a grouped batch moved a request's cache slots (it needed no realignment)"),
        needs=(GROUPED_PAIR,),
        rules=frozenset({"slots-stay"}),
    ),
    Check(
        "order-independence",
        "order independence",
        "the same requests in another pool order (rotated by one row) give the same outputs, permuted",
        {DECODER: order_independence},
        scheduling_signature("the output depends on the order of requests in the pool"),
        needs=(A_BATCH, BUILT_IN_MODEL),
        rules=frozenset({"keeps-contract", "same-output"}),
    ),
    Check(
        "row-independence",
        "rows are independent samples",
        "two rows of one prompt with identical histories emit the same token no more often than independent "
        "samples would (sum of p squared), judged by a test martingale at the verdict's share of 1e-6",
        {SAMPLER: check_row_independence},
        sampling_signature,
        needs=(PAIRED_ROWS,),
        rules=frozenset({"rows-correlated"}),
    ),
    Check(
        "distribution",
        "lossless in distribution",
        "every sampled token is the target's own sample: scored against the exact target distribution given its "
        "row's own prefix (teacher-forced at batch size 1, float64), pooled over rows, positions and seeded runs, "
        "and per role (plain step, a draft's place, bonus), each fit a KS test of randomized PIT values held to "
        "the DKW bound; no token outside p's support, no row stopping early; the verdict's family of tests has "
        "false-alarm probability <= 1e-6 and states the smallest shift it detects",
        {SAMPLER: check_distribution},
        sampling_signature,
        caches=("tokens",),
        rules=frozenset({"impossible-token", "stops-early", "role-fit", "pooled-fit"}),
    ),
)

CHECK_ORDER = tuple(check.name for check in CHECKS)
_BY_NAME = {check.name: check for check in CHECKS}


def validate(checks: tuple[Check, ...]) -> None:
    """What the registry must hold for every subject's judge to dispatch through it (run at
    import, so a gap is an import error, never a KeyError in the middle of a run): names once,
    the contract first (it short-circuits), every subject judged by some check, and the rules that
    `contracts.rules.CHECK_RULES` read from this file's source (what a known-failures file is
    validated against) equal to the entries' own: an entry whose rules are not written as that
    reader understands fails here."""
    names = [check.name for check in checks]
    if len(set(names)) != len(names) or not names or names[0] != "contract":
        raise RegistryError(f"check names {names}: each once, the contract first")
    idle = [s for s in SUBJECTS if not any(s in check.implementations for check in checks)]
    if idle:
        raise RegistryError(f"subjects {idle} are judged by no check")
    if CHECK_RULES != {check.name: check.rules for check in checks} or tuple(CHECK_RULES) != tuple(names):
        raise RegistryError(
            f"contracts.rules.CHECK_RULES names {list(CHECK_RULES)}, the registry {names}, "
            "or other rules: write each entry's rules= as a set literal or a contracts.rules table"
        )


validate(CHECKS)


def check_named(name: str) -> Check:
    """The registry's check called `name` (KeyError naming the known ones otherwise)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no check named {name!r}; the checks are {', '.join(CHECK_ORDER)}") from None


# ---------------------------------------------------------------------------------------
# Judging a subject's evidence


@dataclass(frozen=True)
class CheckOutcome:
    """One check on one subject's evidence: pass, fail (with its violations) or not applicable (with why)."""

    check: str
    status: str  # PASS, FAIL or NOT_APPLICABLE
    violations: tuple[Violation, ...] = ()
    why: str = ""  # for NOT_APPLICABLE: what the evidence lacks


CONTRACT_BROKEN = "the {subject} broke its contract"
COULD_NOT_JUDGE = "could not be judged on this evidence"
STEPPED_SUBJECTS = frozenset({ENGINE})
"""Subjects judged step by step by a judge that keeps state across steps (an engine's). A check
that cannot read a step is a bug of the judge, raised, not reported as not applicable; and the
checks after the step's first failing one are not applicable (the session stops there, and a
later check would read what the earlier one found broken: I2 rows of a malformed batch)."""


def outcome_of(name: str, run: Run) -> CheckOutcome:
    """Check `name` on a decoder's `run`, computed once per run (kept in `run.derived`)."""
    outcomes = run.derived.outcomes
    if name not in outcomes:
        broken = name != "contract" and outcome_of("contract", run).status == FAIL
        outcomes[name] = contract_broken(name, "decoder") if broken else judged(check_named(name), DECODER, run)
    return outcomes[name]


def contract_broken(name: str, subject: str) -> CheckOutcome:
    return CheckOutcome(name, NOT_APPLICABLE, why=CONTRACT_BROKEN.format(subject=subject))


def skipped(name: str, subject: str, outcomes: list[CheckOutcome]) -> CheckOutcome | None:
    """Not applicable after a contract break, or for a stepped subject after any failure."""
    first = next((o for o in outcomes if o.status == FAIL), None)
    if first is None:
        return None
    if first.check == "contract":
        return contract_broken(name, subject)
    if subject in STEPPED_SUBJECTS:
        return CheckOutcome(name, NOT_APPLICABLE, why=f"{first.check} failed first in this {subject} step")
    return None


def judged(check: Check, subject: str, evidence: Any) -> CheckOutcome:
    """`check` on `evidence` of `subject`, through its implementation for that subject."""
    why = check.applies(evidence, subject)
    if why is not None:
        return CheckOutcome(check.name, NOT_APPLICABLE, why=why)
    try:
        found = check.implementations[subject](evidence)
    except Exception as exc:  # a degenerate run the check cannot read is reported, never raised out of a check
        if subject in STEPPED_SUBJECTS:
            raise
        return CheckOutcome(check.name, NOT_APPLICABLE, why=f"{COULD_NOT_JUDGE} ({type(exc).__name__}: {exc})")
    found = sorted(found, key=lambda v: v.call if v.call is not None else 1 << 30)
    return CheckOutcome(check.name, FAIL if found else PASS, tuple(found))


@dataclass(frozen=True)
class Evaluation:
    """Every check of the registry that judges one subject, on one piece of its evidence, in order."""

    outcomes: tuple[CheckOutcome, ...]

    @property
    def violations(self) -> list[Violation]:
        """Every failing check's evidence, ordered by check, then by target call."""
        return [v for outcome in self.outcomes for v in outcome.violations]

    @property
    def first_failure(self) -> CheckOutcome | None:
        return next((o for o in self.outcomes if o.status == FAIL), None)

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    @property
    def statuses(self) -> tuple[tuple[str, str], ...]:
        """(check, status) in order."""
        return tuple((o.check, o.status) for o in self.outcomes)

    def outcome(self, name: str) -> CheckOutcome:
        return next(o for o in self.outcomes if o.check == check_named(name).name)


def checks_for(subject: str) -> tuple[Check, ...]:
    """The checks that judge `subject` (see SUBJECTS), in the registry's order."""
    if subject not in SUBJECTS:
        raise ValueError(f"unknown subject {subject!r}; the subjects are {', '.join(SUBJECTS)}")
    return tuple(check for check in CHECKS if subject in check.implementations)


def order_for(subject: str) -> tuple[str, ...]:
    """The names of the checks that judge `subject`, in the registry's order."""
    return tuple(check.name for check in checks_for(subject))


BATCH_CHECKS = checks_for(DECODER)
BATCH_ORDER = order_for(DECODER)
"""What a batch run (a decoder's, a real model's) is judged by: every check with a decoder implementation."""


def evaluate(subject: str | Run, evidence: Any = None) -> Evaluation:
    """Every check that judges `subject` on its `evidence`, in the registry's order, each through
    its implementation for that subject; after a contract break the others are not applicable
    (for an engine step, after any failure: `STEPPED_SUBJECTS`).

    The one entry every subject's judge calls: `evaluate(DECODER, run)` (or `evaluate(run)`) for a
    decoder's run, `evaluate(ENGINE, step)` for an engine step (`checks.engine_step.EngineStep`),
    `evaluate(BLACK_BOX, answers)` for a black box's (`checks.outputs.OutputEvidence`),
    `evaluate(PAGED, run)` for a paged engine's (`running.paged.PagedRun`)."""
    if not isinstance(subject, str):
        subject, evidence = DECODER, subject
    checks = checks_for(subject)
    if subject == DECODER:
        return Evaluation(tuple(outcome_of(check.name, evidence) for check in checks))
    outcomes: list[CheckOutcome] = []
    for check in checks:
        outcomes.append(skipped(check.name, subject, outcomes) or judged(check, subject, evidence))
    return Evaluation(tuple(outcomes))


def all_violations(run: Run) -> list[Violation]:
    """Every failing check's evidence, ordered by check, then by target call."""
    return list(violations_in_order(run))


def violations_in_order(run: Run, through: str | None = None) -> Iterator[Violation]:
    """`all_violations`, each check judged only when the violations before it are read, none after
    check `through`: a shrinker that keeps a failure class needs the first violation, and no later
    check than its class's (order independence runs the decoder again)."""
    for check in checks_through(through):
        yield from outcome_of(check.name, run).violations


def first_failing(run: Run, through: str | None = None) -> CheckOutcome | None:
    """`evaluate(run).first_failure`, judging no check after it (nor after check `through`)."""
    outcomes = (outcome_of(check.name, run) for check in checks_through(through))
    return next((o for o in outcomes if o.status == FAIL), None)


def checks_through(name: str | None) -> tuple[Check, ...]:
    """The batch checks in order, up to and including `name` (all of them for None)."""
    return BATCH_CHECKS if name is None else BATCH_CHECKS[: BATCH_ORDER.index(name) + 1]


def first_signature(run: Run, through: str | None = None) -> tuple[CheckOutcome, Signature] | None:
    """The first failing check's outcome (up to check `through`) and the signature its first violation maps to."""
    first = first_failing(run, through)
    if first is None:
        return None
    return first, decided(check_named(first.check).signature(first.violations[0], run), run)


def combined(statuses: list[str]) -> str:
    """One check's status over many runs: fail if any failed, pass if any passed, else not applicable."""
    if FAIL in statuses:
        return FAIL
    return PASS if PASS in statuses else NOT_APPLICABLE


# ---------------------------------------------------------------------------------------
# docs/checks.md


def markdown_table() -> str:
    """docs/checks.md's table of checks (the section "## The checks"), rendered from the registry."""
    lines = [
        "| check | property (`properties/`) | what it asserts | judges | not applicable when |",
        "|---|---|---|---|---|",
    ]
    for check in CHECKS:
        when = "; ".join(need.reason if need.subject == DECODER else f"({need.subject}) {need.reason}"
                         for need in check.needs) or "-"  # fmt: skip
        if check.subjects == (SAMPLER,):
            when = "; ".join(["a greedy run: it judges a sampling decoder's seeded runs (`docs/sampling.md`)"]
                             + [need.reason for need in check.needs])  # fmt: skip
        elif DECODER not in check.subjects:
            when = "any batch run: it judges a paged engine's trace (`specaudit observe-vllm`, `make test-vllm`)"
        lines.append(f"| `{check.name}` | {check.title} | {check.statement} | {', '.join(check.subjects)} | {when} |")
    return "\n".join(lines)
