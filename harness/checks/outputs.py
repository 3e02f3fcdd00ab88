"""The output checks over a record, alike for every subject whose forwards are not rows of a batch:
a black box's answers and a paged engine's requests.

Both keep their outputs as a `running.record.Record` (each request: prompt, `max_new_tokens`, its
batch-size-1 oracle, the tokens it returned, whether it was aborted). The registry's contract,
equivalence and liveness checks judge such a record with this module's functions:

  contract     the breaks the transport found (an HTTP error, a `token-count` short answer, an
               engine that raised), and `max-new-tokens`, `ends-at-eos` on every request's tokens
               (the output contract, `OUTPUT_RULES`)
  equivalence  each request against its oracle, tie-aware (`checks.agreement.compare_request`); an
               aborted request's tokens are a prefix of the oracle's
  liveness     `request-finishes`: every request not aborted ends at EOS or `max_new_tokens`

What is compared per request is kept on the evidence (`OutputEvidence.compared`, the equivalence
check's cache), so a subject's report reads the rows the check judged instead of comparing again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specaudit.checks.agreement import RowEquivalence, compare_request, margin_witness
from specaudit.checks.equivalence import divergence
from specaudit.checks.liveness import WaitLedger, settle, unfinished
from specaudit.contracts.violation import Violation
from specaudit.reference.oracle import OracleResult
from specaudit.running.record import Record

OUTPUT_RULES: dict[str, str] = {
    "token-count": "max_tokens tokens unless the output ends at EOS",
    "max-new-tokens": "at most max_tokens new tokens",
    "ends-at-eos": "nothing after the first EOS",
}
"""The output contract on one request's tokens, and what each rule wants."""

OracleFrom = Callable[[tuple[int, ...], int], OracleResult]  # (prefix, max_new_tokens) -> the oracle from there


@dataclass
class OutputEvidence:
    """A record judged at the output level: how ties are judged and re-synced, the contract
    violations the transport already found (an HTTP error, an engine that raised), and what the
    equivalence check compared (its cache, filled once)."""

    record: Record
    dtype: str  # a DTYPES key: the tie tolerance of the oracle's margin
    oracle_from: OracleFrom | None = None  # None: a tie is not re-synced (the comparison stops there)
    errors: dict[int | None, Violation] = field(default_factory=dict)  # request (None: the engine) -> its break
    compared: dict[int, RowEquivalence] = field(default_factory=dict, repr=False)  # the equivalence check's cache


def returned_violation(request: int, tokens: list[int], limit: int, eos: int | None) -> Violation | None:
    """What a request returned: no more than `limit` tokens, nothing after the first EOS."""
    if len(tokens) > limit:
        found = f"{len(tokens)} tokens for max_tokens {limit}"
        return output_violation("max-new-tokens", found, request, {"tokens": len(tokens)})
    if eos is not None and eos in tokens[:-1]:
        return output_violation("ends-at-eos", f"tokens going on after EOS at index {tokens.index(eos)}", request)
    return None


def token_violation(request: int, tokens: list[int], limit: int, eos: int | None) -> Violation | None:
    """A transport's answer: what it returned (`returned_violation`), and all `limit` tokens
    unless it ends at EOS (a request the engine cut short is a broken answer, `token-count`)."""
    returned = returned_violation(request, tokens, limit, eos)
    if returned is not None:
        return returned
    ends = eos is not None and bool(tokens) and tokens[-1] == eos
    if len(tokens) < limit and not ends:
        found = f"{len(tokens)} tokens for max_tokens {limit}, not ending at EOS"
        return output_violation("token-count", found, request, {"tokens": len(tokens)})
    return None


def output_violation(rule: str, found: str, request: int | None, evidence: dict[str, Any] | None = None) -> Violation:
    return Violation("contract", rule, found, OUTPUT_RULES.get(rule, rule), request=request, evidence=evidence or {})


def record_contract(evidence: OutputEvidence) -> list[Violation]:
    """The transport's breaks, then what every other request returned (`returned_violation`); a
    request that stopped short is liveness's (`request-finishes`) or, diverging, equivalence's."""
    found, eos = list(evidence.errors.values()), evidence.record.eos_token_id
    for r, entry in evidence.record.entries.items():
        if r not in evidence.errors:
            found += filter(None, [returned_violation(r, entry.tokens, entry.max_new_tokens, eos)])
    return found


def compared(evidence: OutputEvidence) -> dict[int, RowEquivalence]:
    """Each request without a transport error against its oracle, computed once."""
    if not evidence.compared:
        eos = evidence.record.eos_token_id
        for r, entry in evidence.record.entries.items():
            if r not in evidence.errors:
                evidence.compared[r] = compare_request(entry, eos, tie_judge(evidence.dtype), resync(evidence))
    return evidence.compared


def tie_judge(dtype: str) -> Callable[..., Any]:
    return lambda prefix, index, found, want, margin: margin_witness(index, margin, dtype)


def resync(evidence: OutputEvidence) -> OracleFrom:
    if evidence.oracle_from is not None:
        return evidence.oracle_from

    def unknown(prefix: tuple[int, ...], n: int) -> OracleResult:  # no oracle to continue: stop at the tie
        return OracleResult((), "length", ())

    return unknown


def record_equivalence(evidence: OutputEvidence) -> list[Violation]:
    """One violation per request whose tokens leave its oracle: a finished request equal to it,
    an aborted one a prefix of it."""
    out = []
    for r, row in compared(evidence).items():
        aborted = evidence.record.entries[r].aborted
        if aborted and row.found == row.reference[: len(row.found)]:
            continue
        if not row.equivalent:
            out.append(divergence(row))
    return out


def record_liveness(evidence: OutputEvidence) -> list[Violation]:
    """'request-finishes' (`checks.liveness`) over the record: aborted requests are done."""
    return unfinished(settle(WaitLedger(evidence.record.unit, None, "-"), evidence.record))
