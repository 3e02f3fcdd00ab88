"""The README and docs/ name only what exists: every module path, file, make target and command.

Docs drift silently when code moves; a user copying a path or a command from them then meets an
ImportError or a usage error. So every `specaudit...` name, repository path, `make` target and
`specaudit` subcommand written in them is resolved here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from specaudit.commands.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("harness/", "reference/", "fixtures/", "properties/", "tests/", "bench/", "docs/", ".ci/")
PLACEHOLDERS = ("NAME", "<", "MODULE", "X", "DIR", "FILE", "PKG", "*")


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def spans(page: Path) -> list[str]:
    """The inline code spans of a page: where names and paths are written."""
    return re.findall(r"`([^`\n]+)`", page.read_text(encoding="utf-8"))


def resolve(name: str) -> object:
    """A dotted `specaudit...` name (module, or module attribute chain; `module:attr` too)."""
    name = name.replace(":", ".")
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not ".".join(parts[:cut]).startswith(exc.name):
                raise  # the module exists but needs something missing here (vLLM): not a stale name
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def dotted_names(page: Path) -> list[str]:
    names = []
    for span in spans(page):
        for match in re.finditer(r"\bspecaudit(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?::[A-Za-z_][A-Za-z0-9_]*)?", span):
            if not any(p in match.group(0) for p in ("NAME",)):
                names.append(match.group(0))
    return names


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_module_paths_exist(page: Path) -> None:
    """Every `specaudit.x.y` name a page writes imports (a module or one of its attributes)."""
    missing = []
    for name in dotted_names(page):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            if "vllm" in str(exc) and "specaudit" not in str(exc):
                continue  # vLLM's own modules live in the vLLM venv
            missing.append(f"{name} ({exc})")
    assert not missing, f"{page_id(page)} names what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_repository_paths_exist(page: Path) -> None:
    """Every repository path a page writes (`harness/...`, `tests/...`, `bench/...`) exists."""
    missing = []
    for span in spans(page):
        for token in span.split():
            path = token.split("::")[0].rstrip(".,;:)")
            if not path.startswith(FOLDERS) or any(p in path for p in PLACEHOLDERS):
                continue
            if not (ROOT / path).exists():
                missing.append(path)
    assert not missing, f"{page_id(page)} names paths that do not exist: {missing}"


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M))


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)  # type: ignore[arg-type]


def code(page: Path) -> str:
    """A page's code: its fenced blocks and inline spans, where commands are written to be copied."""
    text = page.read_text(encoding="utf-8")
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    return "\n".join([*blocks, *spans(page)])


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_exist(page: Path) -> None:
    """Every `make X` target and `specaudit SUBCOMMAND` a page's code writes exists."""
    text = code(page)
    targets, commands = make_targets(), subcommands()
    bad = [f"make {t}" for t in re.findall(r"(?:^|[\s$(])make ([a-z][\w-]+)", text, flags=re.M) if t not in targets]
    found = re.findall(r"(?:^|[$/]|(?<!from)(?<!import)\s)specaudit ([a-z][\w-]+)", text, flags=re.M)
    bad += [f"specaudit {c}" for c in found if c not in commands]
    assert not bad, f"{page_id(page)} names commands that do not exist: {bad}"


def test_readme_is_short() -> None:
    """The README is the entry point (what, two commands, a first audit, a failure, where next); the
    reference lives under docs/."""
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 250, f"README.md has {lines} lines, but should have at most 250: move reference to docs/"


def test_the_checks_are_found() -> None:
    """The scan can fail: a made-up module, path and command are reported."""
    with pytest.raises((ImportError, AttributeError)):
        resolve("specaudit.checks.no_such_module")
    assert "no-such-target" not in make_targets()
    assert "no-such-command" not in subcommands()
