"""The one list of checks: what each asserts, in which order, when it applies, and how its
first violation maps to the paper's failure signature.

Everything that judges a run reads this list: the properties (one per check), `audit`,
`gate`, `minimize`, the diagnosis, the JUnit output and docs/checks.md's table of checks. A check
that cannot judge a run (token preservation without the scripted draft, a wait bound the
decoder does not declare, order independence of a single row) is "not applicable" for it,
never a pass. A contract break short-circuits: nothing else is judged on such a run.

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
  contract           the decoder broke the decoder contract, or never called the target.

A signature is decided from the minimal case's evidence (`decided`, `equivalence_signature`):
with no target call it is contract (nothing was attended, so never kv-drift or position-id); on
a case of one row there is no batch to drift across, so kv-drift there is bonus; a wrong token
is re-run alone: wrong alone too is bonus, right alone and read at a pad column of the call
that decided it is position-id.
"""

from __future__ import annotations

from collections.abc import Callable
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
from specaudit.checks.equivalence import pad_columns_read
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
from specaudit.contracts.violation import Violation
from specaudit.running.runner import Run

SIGNATURES = (
    "position-id",
    "kv-drift",
    "bonus",
    "numerical-tie",
    "output-equivalent",
    "bookkeeping",
    "scheduling",
    "contract",
)

PASS, FAIL, NOT_APPLICABLE = "pass", "fail", "not applicable"

Signature = tuple[str, str]  # (signature, reason)


# ---------------------------------------------------------------------------------------
# When a check applies


@dataclass(frozen=True)
class Requirement:
    """Something a run must offer for a check to judge it; `reason` says what is missing."""

    reason: str
    holds: Callable[[Run], bool]
    of_decoder: bool = False  # the decoder lacks it (every run alike), not this one case


SCRIPTED_DRAFT = Requirement("needs the scripted draft", lambda run: run.case.draft == "scripted")
DECLARED_BOUND = Requirement(
    "the decoder declares no max_wait_calls", lambda run: declared_bound(run) is not None, of_decoder=True
)
EVERY_CALL_SEEN = Requirement(
    "target calls were sampled out, so waits cannot be counted",
    lambda run: all(c.sampled for c in run.recording.target_calls),
)
A_BATCH = Requirement("needs a batch of >= 2 rows", lambda run: run.case.batch_size >= 2)
BUILT_IN_MODEL = Requirement(
    "an external-model batch is not re-run in another order (judged on the built-in models)",
    lambda run: run.case.model in MODELS,
)


GROUPED_PAIR = Requirement(
    "no request takes part in two grouped (pad-free) target calls in a row", lambda run: bool(grouped_pairs(run))
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
    if any(v.rule == "verified-kept" for v in judge("token-preservation", run).violations):
        return "kv-drift", "verified tokens' KV was dropped from the cache and the output went wrong"
    alone = run.again(single_row(run.case, row))
    seen = evaluate(alone).first_failure
    wrong = alone.outputs is not None and judge("equivalence", alone).status == FAIL
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
        return "bonus", f"wrong even at batch size 1, so not drift across a batch: {why}"
    return signature


def scheduling_signature(reason: str) -> Callable[[Violation, Run], Signature]:
    return lambda first, run: ("scheduling", reason)


def liveness_signature(first: Violation, run: Run | None) -> Signature:
    """Scheduling, in the subject's own unit (a decoder's target calls, an engine's steps)."""
    if first.rule == "request-finishes":
        return "scheduling", "a request never finished"
    return "scheduling", f"a request waited past its declared bound: {first.found}, wanted {first.expected}"


# ---------------------------------------------------------------------------------------
# The checks


DECODER, ENGINE, BLACK_BOX, VLLM = "decoder", "engine", "black box", "vllm"
SUBJECTS = (DECODER, ENGINE, BLACK_BOX, VLLM)
"""Who a check can judge: a batch decoder's run on the built-in or real models (`Run`), a
white-box engine session after every step (`checks.engine.EngineJudge`), a black box's answers
at the output level (`adapters.engine_blackbox`), an in-process vLLM's paged trace
(`checks.paged`). All but the last keep their evidence as a `running.record.Record`."""


@dataclass(frozen=True)
class Check:
    """One check of the registry; its place in CHECKS is the order violations are reported in."""

    name: str
    title: str  # the property's name in docs/checks.md's table
    statement: str  # one sentence: the docs/checks.md row and the property's docstring
    function: Callable[[Any], list[Violation]]  # the subject's evidence -> violations
    signature: Callable[[Violation, Any], Signature]  # its first violation -> (signature, reason)
    needs: tuple[Requirement, ...] = ()
    per_call: bool = False  # judged on every target call (an invariant), not on the run's output
    subjects: tuple[str, ...] = (DECODER,)  # what it judges (see SUBJECTS)

    def __post_init__(self) -> None:
        unknown = set(self.subjects) - set(SUBJECTS)
        assert self.subjects and not unknown, f"check {self.name}: subjects {sorted(unknown)} not in {SUBJECTS}"

    def unmet(self, run: Run) -> Requirement | None:
        """The first requirement `run` does not offer (None: the check applies)."""
        return next((need for need in self.needs if not need.holds(run)), None)

    def applies(self, run: Run) -> str | None:
        """None when the check judges `run`, else why it is not applicable."""
        unmet = self.unmet(run)
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


def liveness(run: Run) -> list[Violation]:
    return check_liveness(run, declared_bound(run))


CHECKS: tuple[Check, ...] = (
    Check(
        "contract",
        "decoder contract",
        "the decoder returns one list of new token ids per row, in row order, ending at the first EOS or at "
        "`max_new_tokens`, without raising and without hanging (the watchdog's idle limit)",
        check_contract,
        contract_signature,
        subjects=(DECODER, ENGINE, BLACK_BOX),
    ),
    Check(
        "I1",
        "I1 rectangular alignment",
        "every target call: `input_ids` `[B, T]`, mask `[B, P + T]` with `P` the cache length of every layer, "
        "positions `[B, T]`, no row with a real input attending nothing (an all-pad row may)",
        check_i1,
        i1_signature,
        per_call=True,
        subjects=(DECODER, ENGINE),
    ),
    Check(
        "I2",
        "I2 position/KV correspondence",
        "per row of every target call, the attended slots hold the row's prompt and verified tokens at positions "
        "0, 1, 2, ... and the current inputs continue the positions (a call without a cache re-feeds exactly the "
        "committed history); masked slots may hold anything (transparent models are read exactly, tiny real models "
        "against a batch-size-1 run's K/V)",
        check_i2,
        i2_signature,
        per_call=True,
        subjects=(DECODER, ENGINE),
    ),
    Check(
        "equivalence",
        "output equivalence",
        "every row equals the batch-size-1 greedy oracle: tokens, length, stop reason; a divergence within "
        "the noise is a numerical tie and the comparison re-syncs onto the decoder's token (real models: the "
        "two tokens' gap in a higher-precision score of the shared prefix against the measured noise floor; "
        "built-in models: the oracle's top-1/top-2 margin against the dtype's rounding tolerance)",
        check_equivalence,
        equivalence_signature,
        subjects=(DECODER, ENGINE, BLACK_BOX),
    ),
    Check(
        "token-preservation",
        "token preservation",
        "with the scripted draft, each round keeps exactly the drafts the schedule allows: none thrown away, "
        "none kept after rejection",
        check_token_preservation,
        lambda first, run: ("output-equivalent", "the output is right but drafts were lost or kept wrongly"),
        needs=(SCRIPTED_DRAFT,),
    ),
    Check(
        "liveness",
        "liveness",
        "every request finishes, and none waits more target calls than the decoder's declared `max_wait_calls`, "
        "counted from the start of `generate` to its first target call and between two of its calls",
        liveness,
        liveness_signature,
        needs=(DECLARED_BOUND, EVERY_CALL_SEEN),
        subjects=(DECODER, ENGINE, BLACK_BOX),
    ),
    Check(
        "grouped-no-realignment",
        "grouped batches need no realignment",
        "between two grouped (pad-free) target calls of a request its cache slots stay where they were",
        check_grouped_no_realignment,
        scheduling_signature("a grouped batch moved a request's cache slots (it needed no realignment)"),
        needs=(GROUPED_PAIR,),
    ),
    Check(
        "order-independence",
        "order independence",
        "the same requests in another pool order (rotated by one row) give the same outputs, permuted",
        order_independence,
        scheduling_signature("the output depends on the order of requests in the pool"),
        needs=(A_BATCH, BUILT_IN_MODEL),
    ),
    Check(
        "paged",
        "vLLM paged layout",
        "every target forward of an in-process vLLM: the query spans partition the packed tokens, each request's "
        "context length is its committed tokens plus its query, its positions continue its committed length, each "
        "token is written at `block_table[pos // block_size] * block_size + pos % block_size` of its own request, "
        "no block is written by two live requests, and every attended slot holds that request's own K/V",
        check_paged,
        paged_signature,
        per_call=True,
        subjects=(VLLM,),
    ),
)

CHECK_ORDER = tuple(check.name for check in CHECKS)
_BY_NAME = {check.name: check for check in CHECKS}


def check_named(name: str) -> Check:
    """The registry's check called `name` (KeyError naming the known ones otherwise)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no check named {name!r}; the checks are {', '.join(CHECK_ORDER)}") from None


# ---------------------------------------------------------------------------------------
# Judging a run


@dataclass(frozen=True)
class Outcome:
    """One check on one run: pass, fail (with its violations) or not applicable (with why)."""

    check: str
    status: str  # PASS, FAIL or NOT_APPLICABLE
    violations: tuple[Violation, ...] = ()
    why: str = ""  # for NOT_APPLICABLE: what the run lacks


def judge(name: str, run: Run) -> Outcome:
    """Check `name` on `run`, computed once per run (kept in `run.derived`)."""
    outcomes = run.derived.outcomes
    if name not in outcomes:
        outcomes[name] = _judge(check_named(name), run)
    return outcomes[name]


def _judge(check: Check, run: Run) -> Outcome:
    if check.name != "contract" and judge("contract", run).status == FAIL:
        return Outcome(check.name, NOT_APPLICABLE, why="the run broke the decoder contract")
    why = check.applies(run)
    if why is not None:
        return Outcome(check.name, NOT_APPLICABLE, why=why)
    try:
        found = sorted(check.function(run), key=lambda v: v.call if v.call is not None else 1 << 30)
    except Exception as exc:  # a degenerate run the check cannot read is reported, never raised out of a check
        return Outcome(check.name, NOT_APPLICABLE, why=f"could not be judged on this run ({type(exc).__name__}: {exc})")
    return Outcome(check.name, FAIL if found else PASS, tuple(found))


@dataclass(frozen=True)
class Evaluation:
    """Every check of the registry on one run, in order."""

    outcomes: tuple[Outcome, ...]

    @property
    def violations(self) -> list[Violation]:
        """Every failing check's evidence, ordered by check, then by target call."""
        return [v for outcome in self.outcomes for v in outcome.violations]

    @property
    def first_failure(self) -> Outcome | None:
        return next((o for o in self.outcomes if o.status == FAIL), None)

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    @property
    def statuses(self) -> tuple[tuple[str, str], ...]:
        """(check, status) in order."""
        return tuple((o.check, o.status) for o in self.outcomes)

    def outcome(self, name: str) -> Outcome:
        return next(o for o in self.outcomes if o.check == check_named(name).name)


BATCH_CHECKS = tuple(check for check in CHECKS if DECODER in check.subjects)
BATCH_ORDER = tuple(check.name for check in BATCH_CHECKS)
"""What a batch run (a decoder's, a real model's) is judged by: every check but the paged layout's."""


def order_for(subject: str) -> tuple[str, ...]:
    """The checks that judge `subject` (see SUBJECTS), in the registry's order."""
    return tuple(check.name for check in CHECKS if subject in check.subjects)


def evaluate(run: Run) -> Evaluation:
    """Every check of a batch run on `run`; after a contract break the others are not applicable."""
    return Evaluation(tuple(judge(check.name, run) for check in BATCH_CHECKS))


def all_violations(run: Run) -> list[Violation]:
    """Every failing check's evidence, ordered by check, then by target call."""
    return evaluate(run).violations


def first_signature(run: Run) -> tuple[Outcome, Signature] | None:
    """The first failing check's outcome and the signature its first violation maps to."""
    first = evaluate(run).first_failure
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
        when = "; ".join(need.reason for need in check.needs) or "-"
        if VLLM in check.subjects:
            when = "any batch run: it judges an in-process vLLM trace (`specaudit observe-vllm`, `make test-vllm`)"
        lines.append(f"| `{check.name}` | {check.title} | {check.statement} | {', '.join(check.subjects)} | {when} |")
    return "\n".join(lines)
