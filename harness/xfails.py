"""Known failures: a per-decoder list of check violations that are reported, not fatal.

A known-failures file (array-api-tests style) holds one entry per line,

    decoder  model  check  rule        # comment

whitespace-separated; `#` starts a comment, blank lines are skipped, and `*` in any field
matches any run of characters (`specaudit.reference.mutants:*  transparent  I2  *`). A
violation matching an entry is a known failure (xfail); every other violation still fails,
so a new failure cannot hide behind a known one. Torch-free: the CLI and the pytest plugin
load it before anything heavy.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from specaudit.errors import UsageError

FIELDS = ("decoder", "model", "check", "rule")


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

    def __str__(self) -> str:
        return f"{self.source}: {self.decoder} {self.model} {self.check} {self.rule}".lstrip(": ")


@dataclass(frozen=True)
class KnownFailures:
    """The entries of a known-failures file; empty means every violation fails."""

    entries: tuple[KnownFailure, ...] = ()

    def matches(self, decoder: str, model: str, check: str, rule: str) -> bool:
        """Whether a violation of `check` (rule `rule`) by `decoder` on `model` is a known failure."""
        return any(e.matches(decoder, model, check, rule) for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def parse_line(text: str, source: str) -> KnownFailure | None:
    """One line as an entry; None for a blank or comment line; UsageError naming `source` otherwise."""
    fields = text.split("#", 1)[0].split()
    if not fields:
        return None
    if len(fields) != len(FIELDS):
        raise UsageError(f"{source}: got {len(fields)} field(s) {fields}, but should be 4: decoder model check rule")
    return KnownFailure(*fields, source=source)


def load_xfails(path: str | Path) -> KnownFailures:
    """The known failures listed in `path`; a malformed line is a UsageError with `file:line`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read known-failures file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"known-failures file {path} is not UTF-8 text") from None
    entries = (parse_line(line, f"{path}:{n}") for n, line in enumerate(text.splitlines(), start=1))
    return KnownFailures(tuple(e for e in entries if e is not None))
