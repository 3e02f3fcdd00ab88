"""Stop strings judged against the oracle's text and token ids, for any engine that takes them.

The expected output of a greedy request with a stop string is the oracle's continuation cut
where the stop string first appears in its detokenized text (by the engine's own detokenizer):
with `include_stop_str_in_output`, up to and including the token that completes the stop string;
without, the tokens whose text ends before the stop string starts (OpenVINO GenAI's own
non-speculative pipeline does both, measured in bench/results/openvino_audit.md). A speculative
output must equal it in token ids and in text; the rule broken is `stop-string`. A stop string
that starts inside a token and ends in a later one has no token-level answer (OpenVINO keeps the
token it starts in); it is not judged (`judgeable`), and drawn stop strings avoid it (`stop_from`).
A usage count (generated tokens) is judged against the outputs (`usage-count`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from specaudit.contracts.violation import Violation

RULE = "stop-string"


def expected_with_stop(
    decode: Callable[[list[int]], str], oracle: Sequence[int], stop: str, include: bool
) -> list[int] | None:
    """The oracle's tokens as a request with `stop` returns them; None when the stop string does
    not appear within the oracle's tokens (the request then runs to its limit)."""
    tokens = list(oracle)
    last = completing(decode, tokens, stop)
    if last is None:
        return None
    complete = last + 1
    if include:
        return tokens[:complete]
    start = decode(tokens[:complete]).index(stop)
    kept = max(j for j in range(complete) if len(decode(tokens[:j])) <= start)
    return tokens[:kept]


def check_stop(
    decode: Callable[[list[int]], str], oracle: Sequence[int], got: Sequence[int], stop: str, include: bool,
    request: int,
) -> Violation | None:  # fmt: skip
    """A `stop-string` violation when `got` is not the oracle cut at the stop string (ids or text)."""
    want = expected_with_stop(decode, oracle, stop, include)
    if want is None:
        want = list(oracle)
    if list(got) == want and decode(list(got)) == decode(want):
        return None
    found = (f"request {request} with stop string {stop!r} (include_stop_str_in_output={include}) returned "
             f"{list(got)} ({decode(list(got))!r})")  # fmt: skip
    expected = f"the oracle's tokens cut at the stop string: {want} ({decode(want)!r})"
    return Violation("contract", "stop-string", found, expected, request=request)


# ---------------------------------------------------------------------------------------
# Drawn stop strings, the finish reason and the usage count (added for drawn workloads)

USAGE_RULE = "usage-count"


def boundaries(decode: Callable[[list[int]], str], tokens: Sequence[int]) -> list[int] | None:
    """Where each token's text starts and the last ends in `decode(tokens)` (len n + 1); None when
    a prefix's text is not a prefix of the whole (no token-level answer for a stop string there)."""
    texts = [decode(list(tokens[:j])) for j in range(len(tokens) + 1)]
    if any(not texts[-1].startswith(text) for text in texts):
        return None
    return [len(text) for text in texts]


def judgeable(decode: Callable[[list[int]], str], tokens: Sequence[int], stop: str, include: bool = True) -> bool:
    """Whether `stop`'s first appearance in the tokens' text has a token-level answer: it does not
    start inside a token and end in a later one, nor start inside a token when it is not included
    (the text before it in that token cannot be kept without the token: OpenVINO keeps the token), and
    no token it spans decodes to "" (OpenVINO's non-speculative pipeline never matches across such a
    token). Not appearing is judgeable."""
    complete = completing(decode, tokens, stop)
    if complete is None:
        return True
    tokens = list(tokens)[: complete + 1]  # only the text up to the stop matters
    cuts = boundaries(decode, tokens)
    if cuts is None:
        return False
    start = decode(tokens).find(stop)
    end = start + len(stop)
    first = max(j for j in range(len(tokens)) if cuts[j] <= start)
    last = min(j for j in range(len(tokens)) if cuts[j + 1] >= end)
    inside = bool(decode(tokens)[cuts[first] : start].strip()) and (last > first or not include)  # past its separator
    empty = any(cuts[j + 1] == cuts[j] for j in range(first, last + 1))
    return not inside and not empty


def stop_from(
    decode: Callable[[list[int]], str], tokens: Sequence[int], start: int, n: int, head: int, tail: int,
    include: bool = True,
) -> str | None:  # fmt: skip
    """A stop string: the text of `tokens[start:start + n]` decoded alone (as an engine decoding its
    last tokens sees it, without the separator the whole text puts before them), less `head`
    characters at its start (only for one token: starting inside a token and ending in a later one is
    unjudgeable) and `tail` at its end; None when that is blank, out of range, not in the whole text
    or not `judgeable` there."""
    if n < 1 or start + n > len(tokens):
        return None
    text = decode(list(tokens[start : start + n]))
    stop = text[(head if n == 1 else 0) : len(text) - tail]
    fits = stop.strip() == stop and stop and stop in decode(list(tokens[: start + n]))
    return stop if fits and judgeable(decode, tokens, stop, include) else None


def completing(decode: Callable[[list[int]], str], tokens: Sequence[int], stop: str) -> int | None:
    """Index of the token whose text completes `stop`'s first appearance; None when it does not appear."""
    tokens = list(tokens)
    return next((n - 1 for n in range(1, len(tokens) + 1) if stop in decode(tokens[:n])), None)


def check_stop_output(
    decode: Callable[[list[int]], str], oracle: Sequence[int], ids: Sequence[int], text: str, stop: str,
    include: bool, request: int, finish: str | None = None,
) -> Violation | None:  # fmt: skip
    """`check_stop` on the ids, then the text the engine reports (it may trim its text apart from its
    ids) and, where the engine reports one, the finish reason: "stop" when the stop string ended the
    request within its limit (`oracle` is cut at the limit), even on the limit's last token."""
    violation = check_stop(decode, oracle, ids, stop, include, request)
    if violation is not None:
        return replace(violation, found=f"{violation.found}; its text {text!r}")
    want = expected_with_stop(decode, oracle, stop, include)
    if text != decode(list(ids)):
        found = f"request {request} with stop string {stop!r} returned ids {list(ids)} but text {text!r}"
        return Violation("contract", "stop-string", found, f"the text of its ids, {decode(list(ids))!r}",
                         request=request)  # fmt: skip
    return None if want is None else finish_violation(finish, stop, request)


def finish_violation(finish: str | None, stop: str, request: int) -> Violation | None:
    """A `stop-string` violation when a request its stop string ended reports another finish reason
    (None: the engine reports none)."""
    if finish is None or finish == "stop":
        return None
    found = f"request {request} ended at its stop string {stop!r} with finish reason {finish!r}"
    return Violation("contract", "stop-string", found, "finish reason 'stop'", request=request)


def expected_usage(
    decode: Callable[[list[int]], str], oracle: Sequence[int], ids: Sequence[int], stop: str | None, include: bool
) -> int:
    """The generated-token count a request's output implies: its tokens, plus the stop string's tokens
    trimmed from them (generated, then cut) when the stop string ended it without being included."""
    kept = None if stop is None or include else expected_with_stop(decode, oracle, stop, False)
    if kept is None:
        return len(ids)
    return len(ids) + len(expected_with_stop(decode, oracle, stop, True) or []) - len(kept)


def check_usage(reported: int, expected: int, request: int, what: str = "generated tokens") -> Violation | None:
    """A `usage-count` violation when the engine's count of a request's `what` is not its outputs'."""
    if reported == expected:
        return None
    found = f"request {request} reported {reported} {what}"
    evidence = {"reported": reported, "expected": expected}
    return Violation("contract", "usage-count", found, f"{expected}, as its outputs give", request=request,
                     evidence=evidence)  # fmt: skip
