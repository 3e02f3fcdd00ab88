"""Token roles in a sampled run: which target forward decided each sampled token, and as what.

A token x_n of a row is decided by the first target forward whose logits are computed for its
prefix h_n (prompt + the row's tokens before it): some row of that call attends exactly h_n at
positions 0, 1, ..., and a query column sits on its last entry. That call says the role:

    draft   the call also feeds an input right after h_n: a draft was verified at x_n's place
            (x_n is that draft, accepted, or the token drawn after rejecting it);
    bonus   no input after h_n, but x_n's round already accepted drafts in this call
            (x_{n-1} was decided by the same call): the token after the accepted run;
    plain   no input after h_n and nothing accepted before it: a step without a draft (the
            first token after the prefill, a round of K = 0);
    unknown no observed forward computed logits for h_n.

`slot` counts the drafts the round accepted before x_n (the acceptance count), `round` the
deciding calls of the row before x_n's. A lossless sampler draws x_n from p(. | h_n) whatever
its role: the role is fixed by forwards made before x_n is drawn, so every role's tokens are
tested against p on their own, and a mistaken role (an exotic call pattern) costs power, never
a false alarm. Rows are identified by content, so two rows with one history share their facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from specaudit.checks.observe import observe
from specaudit.running.instrument import CallRecord

ROLES = ("plain", "draft", "bonus")
UNKNOWN_ROLE = "unknown"


@dataclass(frozen=True)
class Decision:
    """The first forward that computed logits for one prefix, and whether it fed an input after it."""

    call: int  # target call index
    row: int  # its batch row
    next_token: int | None  # the input fed right after the prefix in that call (None: none)


@dataclass(frozen=True)
class Role:
    """One sampled token's role."""

    role: str  # ROLES or UNKNOWN_ROLE
    slot: int  # drafts accepted before it in its round
    round: int  # its row's deciding calls before this token's
    call: int | None  # the deciding target call
    row: int | None  # the batch row in that call
    accepted: bool = False  # a draft role whose token is the draft fed there


def prefix_key(key: int, token: int) -> int:
    """The running hash of a token sequence, one token at a time."""
    return hash((key, token))


def decisions(calls: list[CallRecord]) -> dict[int, Decision]:
    """prefix hash -> its deciding forward, over every well-formed row of every target call."""
    found: dict[int, Decision] = {}
    for call in calls:
        if call.input_ids is None or call.input_ids.dim() != 2:
            continue
        obs = observe(call, exact=True)
        tokens, positions = obs.tokens.tolist(), obs.positions.tolist()
        for b, (length, past) in enumerate(zip(obs.length.tolist(), obs.past.tolist())):
            row_tokens, row_positions = tokens[b][:length], positions[b][:length]
            key = 0
            for e, (token, position) in enumerate(zip(row_tokens, row_positions)):
                if position != e:  # positions off 0, 1, 2, ...: I2's to report, no prefix here
                    break
                key = prefix_key(key, token)
                if e >= past and key not in found:  # a query column on the prefix's last entry
                    after = row_tokens[e + 1] if e + 1 < length else None
                    found[key] = Decision(call.index, b, after)
    return found


def roles_of(prompt: tuple[int, ...], tokens: list[int], found: dict[int, Decision]) -> list[Role]:
    """The role of each sampled token of one row (see the module's table)."""
    key = 0
    for token in prompt:
        key = prefix_key(key, token)
    roles: list[Role] = []
    rounds, previous = 0, None
    for token in tokens:
        decision = found.get(key)
        if decision is None:
            roles.append(Role(UNKNOWN_ROLE, 0, rounds, None, None))
            previous = None
        else:
            same = previous is not None and previous.role == "draft" and previous.call == decision.call
            slot = previous.slot + 1 if same and previous is not None else 0
            if previous is not None and not same:
                rounds += 1
            role = "draft" if decision.next_token is not None else ("bonus" if slot else "plain")
            previous = Role(role, slot, rounds, decision.call, decision.row, decision.next_token == token)
            roles.append(previous)
        key = prefix_key(key, token)
    return roles
