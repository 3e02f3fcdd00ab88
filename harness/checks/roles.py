"""Token roles in a sampled run: which target forward decided each sampled token, and as what.

A token x_n of a request is decided by the first target forward whose logits are computed for its
prefix h_n (prompt + the request's tokens before it): the request's row in that call (bound to
it by I2's row follower, `checks.rows`) attends exactly h_n, and a query column sits on its last
entry. That call says the role:

    draft   the call also feeds an input right after h_n: a draft was verified at x_n's place
            (x_n is that draft, accepted, or the token drawn after rejecting it);
    bonus   no input after h_n, but x_n's round already accepted drafts in this call
            (x_{n-1} was decided by the same call): the token after the accepted run;
    plain   no input after h_n and nothing accepted before it: a step without a draft (the
            first token after the prefill, a round of K = 0);
    unknown no observed forward computed logits for h_n.

`slot` counts the drafts the round accepted before x_n (the acceptance count), `round` the
deciding calls of the request before x_n's. A lossless sampler draws x_n from p(. | h_n)
whatever its role: the role is fixed by forwards made before x_n is drawn, so every role's
tokens are tested against p on their own, and a mistaken role (an exotic call pattern) costs
power, never a false alarm.
"""

from __future__ import annotations

from dataclasses import dataclass

from specaudit.checks.rows import RowView

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


def decisions(views: list[RowView], sequences: list[tuple[int, ...]]) -> dict[tuple[int, int], Decision]:
    """(request, prefix length) -> its deciding forward, over every bound row of every target call
    (`views` in call order; `sequences` each request's prompt + sampled tokens)."""
    found: dict[tuple[int, int], Decision] = {}
    for view in views:
        sequence = sequences[view.request]
        for e in range(view.past, len(view.stream)):  # a query column on stream entry e: logits for stream[:e + 1]
            if e >= len(sequence) or view.stream[e] != sequence[e]:
                break  # past the request's own history (a rejected draft), or not its history at all
            after = view.stream[e + 1] if e + 1 < len(view.stream) else None
            found.setdefault((view.request, e + 1), Decision(view.call, view.row, after))
    return found


def roles_of(request: int, prompt: int, tokens: list[int], found: dict[tuple[int, int], Decision]) -> list[Role]:
    """The role of each sampled token of one request (see the module's table)."""
    roles: list[Role] = []
    rounds, previous = 0, None
    for n, token in enumerate(tokens):
        decision = found.get((request, prompt + n))
        if decision is None:
            roles.append(Role(UNKNOWN_ROLE, 0, rounds, None, None))
            previous = None
            continue
        same = previous is not None and previous.role == "draft" and previous.call == decision.call
        slot = previous.slot + 1 if same and previous is not None else 0
        if previous is not None and not same:
            rounds += 1
        role = "draft" if decision.next_token is not None else ("bonus" if slot else "plain")
        previous = Role(role, slot, rounds, decision.call, decision.row, decision.next_token == token)
        roles.append(previous)
    return roles
