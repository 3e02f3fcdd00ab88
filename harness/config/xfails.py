"""Known failures: a per-decoder list of check violations that are reported, not fatal.

A known-failures file (array-api-tests style) holds one entry per line,

    decoder  model  check  rule        # comment

whitespace-separated; `#` starts a comment, blank lines are skipped, and `*` in any field
matches any run of characters (`specaudit.reference.mutants:*  transparent  I2  *`). A
violation matching an entry is a known failure (xfail); every other violation still fails,
so a new failure cannot hide behind a known one. Torch-free: the CLI and the pytest plugin
load it before anything heavy.

A typo must not silently match nothing, so each entry is validated on load: the decoder is a
`module:attr` spec (or a pattern with `*`), the model a built-in model (`specaudit.contracts.builtins`:
known failures apply to the built-in models only, the real-model mode refuses --xfails), the check a
check of the registry and the rule one that check emits (`specaudit.contracts.rules`); a partial
wildcard (`I*`, `q*`) must match at least one name.
Entries are marked as they match, and the commands list those that matched no failure.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from specaudit.contracts.builtins import MODELS
from specaudit.contracts.errors import UsageError
from specaudit.contracts.rules import CHECK_NAMES, CHECK_RULES

FIELDS = ("decoder", "model", "check", "rule")
DECODER_SPEC = re.compile(r"[\w.*]+:[\w.*]+|[\w.*:]*\*[\w.*:]*")
"""`module:attr` (dotted names, `*` anywhere), or any pattern with a `*` (it may span the colon)."""


@functools.cache
def _pattern(field: str) -> re.Pattern[str]:
    """`field` as a full-match pattern in which only `*` is special."""
    return re.compile(".*".join(re.escape(part) for part in field.split("*")))


@dataclass(frozen=True)
class KnownFailure:
    """One entry: four field patterns and where it was written (`file:line`)."""

    decoder: str
    model: str
    check: str
    rule: str
    source: str = ""

    def matches(self, decoder: str, model: str, check: str, rule: str) -> bool:
        fields = zip((self.decoder, self.model, self.check, self.rule), (decoder, model, check, rule))
        return all(_pattern(pattern).fullmatch(value) is not None for pattern, value in fields)

    @property
    def fields(self) -> str:
        return f"{self.decoder} {self.model} {self.check} {self.rule}"

    def __str__(self) -> str:
        return f"{self.source}: {self.fields}".lstrip(": ")


@dataclass(frozen=True)
class KnownFailures:
    """The entries of a known-failures file; empty means every violation fails. `used` holds the
    indices of the entries that matched a violation so far (merged back from worker processes)."""

    entries: tuple[KnownFailure, ...] = ()
    used: set[int] = field(default_factory=set, compare=False, repr=False)

    def matches(self, decoder: str, model: str, check: str, rule: str) -> bool:
        """Whether a violation of `check` (rule `rule`) by `decoder` on `model` is a known failure;
        every entry that matches it is marked used."""
        hits = {i for i, e in enumerate(self.entries) if e.matches(decoder, model, check, rule)}
        self.used.update(hits)
        return bool(hits)

    def mark_used(self, indices: Iterable[int]) -> None:
        """Fold in the entries another copy of this file (a worker's) saw matching."""
        self.used.update(i for i in indices if 0 <= i < len(self.entries))

    def unused(self) -> list[KnownFailure]:
        """The entries that matched no violation, in file order."""
        return [e for i, e in enumerate(self.entries) if i not in self.used]

    def unused_lines(self) -> list[str]:
        """One line per entry that matched nothing: `file:line: entry matched no failure (...)`."""
        return [f"{e.source or 'entry'}: entry matched no failure ({e.fields})" for e in self.unused()]

    def __len__(self) -> int:
        return len(self.entries)


def _first_match(pattern: str, names: Iterable[str]) -> bool:
    return any(_pattern(pattern).fullmatch(name) for name in names)


def validate(entry: KnownFailure) -> None:
    """UsageError naming `file:line` when a field cannot match what the harness reports."""
    where = entry.source or "known-failures entry"
    if DECODER_SPEC.fullmatch(entry.decoder) is None:
        raise UsageError(
            f"{where}: decoder {entry.decoder!r} is not a decoder spec; "
            "should be module:attr, '*' allowed (e.g. specaudit.reference.mutants:* or *)"
        )
    if not _first_match(entry.model, MODELS):  # a misspelt model (`gtp2`) would never match a violation
        raise UsageError(f"{where}: unknown model {entry.model!r}; should be one of {', '.join(MODELS)} or *")
    checks = [c for c in CHECK_NAMES if _pattern(entry.check).fullmatch(c)]
    if not checks:
        raise UsageError(f"{where}: unknown check {entry.check!r}; should be one of {', '.join(CHECK_NAMES)} or *")
    rules = sorted(set().union(*(CHECK_RULES[c] for c in checks)))
    if not _first_match(entry.rule, rules):
        what = f"check {checks[0]}" if len(checks) == 1 else f"checks {entry.check}"
        raise UsageError(f"{where}: unknown rule {entry.rule!r} for {what}; should be one of {', '.join(rules)} or *")


RENAMED_RULES = {
    ("liveness", "wait-bound"): "bounded-*",
    ("liveness", "finishes"): "request-finishes",
    ("equivalence", "oracle-prefix"): "first-divergence",
}
"""Engine rules named apart from a decoder's until both became one check's; a file that lists an
old name still means the same violations ('wait-bound' covered the queue wait too)."""


def parse_line(text: str, source: str) -> KnownFailure | None:
    """One line as an entry; None for a blank or comment line; UsageError naming `source` otherwise."""
    fields = text.split("#", 1)[0].split()
    if not fields:
        return None
    if len(fields) != len(FIELDS):
        raise UsageError(f"{source}: got {len(fields)} field(s) {fields}, but should be 4: decoder model check rule")
    decoder, model, check, rule = fields
    entry = KnownFailure(decoder, model, check, RENAMED_RULES.get((check, rule), rule), source=source)
    validate(entry)
    return entry


def load_xfails(path: str | Path) -> KnownFailures:
    """The known failures listed in `path`; a malformed or unknown entry is a UsageError with `file:line`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read known-failures file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"known-failures file {path} is not UTF-8 text") from None
    entries = (parse_line(line, f"{path}:{n}") for n, line in enumerate(text.splitlines(), start=1))
    return KnownFailures(tuple(e for e in entries if e is not None))
