"""Stop strings judged against the oracle's text and token ids.

The expected output of a greedy request with a stop string is the oracle's continuation cut
where the stop string first appears in its detokenized text (the tiny Llama's tokenizer
detokenizes, through openvino-tokenizers): with `include_stop_str_in_output`, up to and
including the token that completes the stop string; without, the tokens whose text ends before
the stop string starts (OpenVINO GenAI's own non-speculative pipeline does both, measured in
bench/results/openvino_audit.md). A speculative output must equal it in token ids and in text;
the rule broken is `stop-string`. A stop string that starts inside a token and ends in a later
one has no token-level answer (OpenVINO keeps the token it starts in); it is not judged.
Drawn workloads carry no stop strings yet: `tests/adapters/test_openvino.py` judges fixed ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specaudit.contracts.violation import Violation

RULE = "stop-string"


def expected_with_stop(
    decode: Callable[[list[int]], str], oracle: Sequence[int], stop: str, include: bool
) -> list[int] | None:
    """The oracle's tokens as a request with `stop` returns them; None when the stop string does
    not appear within the oracle's tokens (the request then runs to its limit)."""
    tokens = list(oracle)
    complete = next((n for n in range(1, len(tokens) + 1) if stop in decode(tokens[:n])), None)
    if complete is None:
        return None
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
