"""The public API (`specaudit.__all__`, docs/api.md): every name imports, is its home module's own
object and is documented; `import specaudit` stays cheap; moved modules and names keep their old
paths with a DeprecationWarning; the exit-code constants are what the command line returns."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import specaudit
from specaudit._moved import DEPRECATIONS, MODULES, NAMES, REMOVED_IN

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "api.md"
EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"


def home(name: str) -> object:
    """The object a public name stands for, read from its home module directly."""
    module, _, attr = specaudit._PUBLIC[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def documented() -> dict[str, list[str]]:
    """docs/api.md's name tables: each public name's row as its cells."""
    rows = {}
    for line in API_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells
    return rows


def python(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter: nothing imported before it."""
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def fresh(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """Forget an old module path, so that importing it runs (and warns) again."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    parent, _, child = old.rpartition(".")
    monkeypatch.delattr(sys.modules[parent], child, raising=False)


# ---------------------------------------------------------------------------------------
# The names


def test_import_specaudit_imports_nothing_else() -> None:
    """`import specaudit` loads neither torch nor any module of the package (the pytest plugin's start-up)."""
    done = python("""
        import sys
        import specaudit
        assert "torch" not in sys.modules, "torch imported"
        print(sorted(m for m in sys.modules if m.startswith("specaudit")))
    """)
    assert done.returncode == 0 and done.stdout.strip() == "['specaudit']", done.stdout + done.stderr


def test_every_public_name_imports() -> None:
    """Every name of `__all__` in a fresh interpreter, none through a deprecated path
    (DeprecationWarning is an error here)."""
    done = python(
        "import specaudit\nfor name in specaudit.__all__: getattr(specaudit, name)", "-W", "error::DeprecationWarning"
    )
    assert done.returncode == 0, done.stderr[-3000:]


HOMES = sorted({home.partition(":")[0] for home in specaudit._PUBLIC.values()})

FORKED_IMPORTS = """
    import importlib, json, os, sys, traceback
    import specaudit

    def imported(names):
        # the forked child's whole work: the home's names through `specaudit`, first thing
        try:
            for name in names:
                getattr(specaudit, name)
            return ""
        except BaseException:
            return traceback.format_exc()[-3000:]

    def in_child(work):
        # `work()` in a forked copy of this interpreter: its error text, "" if none
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.write(write, work().encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            text = pipe.read()
        _, status = os.waitpid(pid, 0)
        return text or ("" if status == 0 else f"child exited with status {status}")

    def third_party(names):
        # the modules outside specaudit that importing every home pulls in
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            imported(names)
            os.write(write, json.dumps([m for m in sys.modules if not m.startswith("specaudit")]).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            modules = json.loads(pipe.read())
        os.waitpid(pid, 0)
        return modules

    homes = json.loads(sys.argv[1])
    for module in third_party([n for names in homes.values() for n in names]):
        try:
            importlib.import_module(module)
        except BaseException:
            pass
    loaded = sorted(m for m in sys.modules if m.startswith("specaudit"))
    assert loaded == ["specaudit"], loaded
    print(json.dumps({module: in_child(lambda: imported(names)) for module, names in homes.items()}))
"""
"""One interpreter for all homes: it imports the third-party modules they need (torch,
transformers: most of an interpreter's start) but no specaudit module, then forks one child per
home, which imports it first thing (one fresh interpreter per home took about 5 s each)."""


@pytest.fixture(scope="module")
def home_imports() -> dict[str, str]:
    """Each home module's import error text in its own forked interpreter ("" where it imported)."""
    homes = {m: [n for n, where in specaudit._PUBLIC.items() if where.startswith(f"{m}:")] for m in HOMES}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORKED_IMPORTS), json.dumps(homes)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("module", HOMES)
def test_each_home_module_imports_first(module: str, home_imports: dict[str, str]) -> None:
    """A public name's home imported first thing in its own interpreter: no import cycle hides
    behind the order in which other names happened to be imported."""
    assert home_imports[module] == "", f"importing {module} first: {home_imports[module]}"


@pytest.mark.parametrize("name", specaudit.__all__)
def test_a_public_name_is_its_home_modules_own_object(name: str) -> None:
    """`specaudit.NAME` is the object defined in its home module (no copy, no wrapper)."""
    assert getattr(specaudit, name) is home(name)
    assert name in dir(specaudit)


def test_a_name_outside_the_api_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'EqSpec'"):
        specaudit.EqSpec  # noqa: B018
    with pytest.raises(ImportError):
        from specaudit import not_a_name  # noqa: F401


def test_every_public_name_is_documented_where_it_lives() -> None:
    """docs/api.md has one row per name of `__all__` (and no other), naming its home module."""
    rows = documented()
    assert sorted(rows) == sorted(specaudit.__all__), set(rows) ^ set(specaudit.__all__)
    wrong = [
        f"{name}: {rows[name][2]}, but should name {specaudit._PUBLIC[name].partition(':')[0]}"
        for name in specaudit.__all__
        if f"`{specaudit._PUBLIC[name].partition(':')[0]}`" not in rows[name][2]
    ]
    assert not wrong, "\n".join(wrong)


def documented_aliases() -> list[tuple[str, str]]:
    return [(name, alias) for name, cells in documented().items() for alias in re.findall(r"`([\w.]+)`", cells[3])]


@pytest.mark.parametrize(("name", "alias"), documented_aliases())
def test_a_documented_alias_imports_with_a_warning(name: str, alias: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each deprecated alias docs/api.md lists still gives the public object, warning with its new home."""
    module, _, attr = alias.rpartition(".")
    if module in MODULES:
        fresh(monkeypatch, module)
    new = specaudit._PUBLIC[name].partition(":")[0]
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        value = getattr(importlib.import_module(module), attr)
    assert value is home(name)


def test_every_moved_path_is_documented_and_has_its_file() -> None:
    """Each old module of `specaudit._moved` is a file at its old place (the package root, or a
    subpackage a module left: `specaudit.artifacts.audit`) and a row of docs/api.md; each moved
    name's old module is named there too."""
    text = API_DOC.read_text()
    missing = [old for old in MODULES if f"| `{old}` |" not in text]
    missing += [old for old in NAMES if f"`{old.rpartition('.')[0]}." not in text]
    assert not missing, f"not in docs/api.md: {missing}"
    package = Path(specaudit.__file__).parent
    files = {
        "specaudit." + ".".join(p.relative_to(package).with_suffix("").parts)
        for p in package.rglob("*.py")
        if "_alias(" in p.read_text()
    }
    assert files == set(MODULES), files ^ set(MODULES)


def test_crop_cache_keeps_the_first_slots_in_every_version() -> None:
    """`crop_cache(cache, keep)` keeps the first `keep` slots of every layer; keeping as many as
    are filled, or more, removes nothing (`crop(0)` would empty the cache before transformers 5.15)."""
    import torch

    kv = [
        (torch.arange(20.0).reshape(2, 1, 5, 2) + layer, torch.zeros(2, 1, 5, 2)) for layer in range(3)
    ]  # [B, H, S, D]
    cache = specaudit.cache_from_tensors(kv)
    specaudit.crop_cache(cache, 5)
    specaudit.crop_cache(cache, 7)
    assert specaudit.layer_lengths(cache) == (5, 5, 5)
    specaudit.crop_cache(cache, 3)
    assert specaudit.layer_lengths(cache) == (3, 3, 3)
    assert all(torch.equal(k, kv[i][0][..., :3, :]) for i, (k, _) in enumerate(specaudit.cache_layers(cache)))


# ---------------------------------------------------------------------------------------
# Moved paths


def test_the_old_compat_path_imports_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: an adapter's `from specaudit.compat import ...` works, warns once at its
    own import line, and gets the cache layer's own functions."""
    from specaudit.models import compat

    fresh(monkeypatch, "specaudit.compat")
    moved = r"specaudit\.compat is deprecated: it moved to specaudit\.models\.compat"
    with pytest.warns(DeprecationWarning, match=moved) as seen:
        from specaudit.compat import cache_layers, crop_cache
    assert (cache_layers, crop_cache) == (compat.cache_layers, compat.crop_cache)
    assert [w.filename for w in seen] == [__file__], "the warning should point at the importing line"
    import specaudit.compat as old

    assert old.select_rows is compat.select_rows and "cache_keyword" in dir(old)
    with pytest.raises(AttributeError, match="now 'specaudit.models.compat'"):
        old.no_such_helper  # noqa: B018


def test_an_old_module_follows_its_names_that_moved_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`specaudit.engine_machine.replay` (the engine regression tests specaudit once wrote) is now
    `specaudit.search.engine_replay.replay`; the warning says both moves."""
    from specaudit.search import engine_machine, engine_replay

    fresh(monkeypatch, "specaudit.engine_machine")
    with pytest.warns(DeprecationWarning, match=r"its .*replay to specaudit\.search\.engine_replay\.replay"):
        from specaudit.engine_machine import EngineMachine, replay
    assert replay is engine_replay.replay and EngineMachine is engine_machine.EngineMachine


@pytest.mark.parametrize("old", sorted(NAMES))
def test_a_name_that_left_its_module_warns_at_each_use(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, _, attr = old.rpartition(".")
    if module in MODULES:
        fresh(monkeypatch, module)
    new_module, _, new_attr = NAMES[old].rpartition(".")
    with pytest.warns(DeprecationWarning, match=re.escape(NAMES[old])):
        value = getattr(importlib.import_module(module), attr)
    assert value is getattr(importlib.import_module(new_module), new_attr)


OLD_REGRESSION_TEST_IMPORTS = """
from specaudit.case import Case
from specaudit.registry import all_violations
from specaudit.reproducer import remember_failure, remember_engine_failure
from specaudit.violation import explain, render
from specaudit.runner import run_case
from specaudit.engine_machine import replay
"""
"""The imports of the regression tests specaudit wrote before 97aaf06 (`_TEMPLATE` and
`_ENGINE_TEMPLATE` of specaudit.reproducer then): those files live on in users' repositories."""


def test_regression_tests_written_before_the_move_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old regression tests' imports run, each old module warning once."""
    old = re.findall(r"^from (specaudit\.\w+) import", OLD_REGRESSION_TEST_IMPORTS, re.M)
    for module in old:
        fresh(monkeypatch, module)
    with pytest.warns(DeprecationWarning) as seen:
        exec(OLD_REGRESSION_TEST_IMPORTS, {})
    warned = [str(w.message).split()[0] for w in seen if issubclass(w.category, DeprecationWarning)]
    assert warned == old, warned


REGRESSION_TEST_IMPORTS_BEFORE_AUDITS = """
from specaudit.artifacts.reproducer import remember_failure
from specaudit.artifacts.reproducer import remember_engine_failure
"""
"""The imports of the regression tests specaudit wrote before the audits layer (issue 26): the
pytest notes then lived in the reproducer module, which is now the envelope format only."""


def test_regression_tests_written_before_the_audits_layer_still_run() -> None:
    """Their imports resolve to the notes' new home, warning with it."""
    from specaudit.commands import pytest_notes

    names: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match=r"specaudit\.commands\.pytest_notes\.remember_") as seen:
        exec(REGRESSION_TEST_IMPORTS_BEFORE_AUDITS, names)
    assert names["remember_failure"] is pytest_notes.remember_failure and len(seen) == 2
    assert names["remember_engine_failure"] is pytest_notes.remember_engine_failure


# ---------------------------------------------------------------------------------------
# Exit codes


def test_the_exit_codes_are_the_documented_ones() -> None:
    assert (specaudit.EXIT_PASS, specaudit.EXIT_FAIL, specaudit.EXIT_USAGE) == (0, 1, 2)


def test_the_command_line_returns_the_exit_constants(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`specaudit replay` of one small case: EXIT_PASS for EqSpec, EXIT_FAIL for a planted bug,
    EXIT_USAGE for an unreadable file and an unknown option."""
    case = specaudit.Case(((5,),), ((False,) * 6,), 1, 3, None, 0)
    path = case.save(tmp_path / "case.json")
    assert specaudit.main(["replay", str(path), "--decoder", EQSPEC]) == specaudit.EXIT_PASS
    assert specaudit.main(["replay", str(path), "--decoder", MUTANT]) == specaudit.EXIT_FAIL
    assert specaudit.main(["replay", str(tmp_path / "missing.json"), "--decoder", EQSPEC]) == specaudit.EXIT_USAGE
    assert specaudit.main(["replay", "--no-such-option"]) == specaudit.EXIT_USAGE
    capsys.readouterr()


def test_a_replayed_reproducer_through_the_public_api(tmp_path: Path) -> None:
    """What an adapter does with a failure: load the case and replay it, all from `specaudit`."""
    path = specaudit.Case(((5,),), ((False,) * 6,), 1, 3, None, 0).save(tmp_path / "case.json")
    assert specaudit.load_case(path) == specaudit.Case.from_json(specaudit.load_reproducer(path).to_json())
    outcome = specaudit.replay_reproducer(path, MUTANT)
    assert isinstance(outcome, specaudit.Diagnosis) and not outcome.passed and outcome.first_check == "I2"
    assert all(isinstance(v, specaudit.Violation) for v in outcome.violations)


# ---------------------------------------------------------------------------------------
# Issue 38: generated files use the public API; every deprecation is dated; internal-move shims gone


def specaudit_imports(source: str) -> list[tuple[str, str]]:
    """(module, name) of every `from specaudit... import name` in `source`."""
    import ast

    return [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specaudit"
        for alias in node.names
    ]


def test_written_regression_tests_import_only_the_public_api(tmp_path: Path) -> None:
    """A decoder's and an engine's written regression test import names of `specaudit.__all__`, from
    `specaudit` itself: an internal move can no longer break them (and needs no shim)."""
    from specaudit.audits.regression import engine_regression_test_source, regression_test_source
    from specaudit.checks.diagnosis import diagnose
    from specaudit.running.runner import run_case as run

    diagnosis = diagnose(run(MUTANT, specaudit.Case(((5,),), ((False,) * 6,), 1, 3, None, 0)))
    rules = {"engine": "x:Y", "num_draft_tokens": 2, "eos_token_id": None, "pad_token_id": 0, "ops": []}
    for source in (regression_test_source(diagnosis, "t"), engine_regression_test_source(rules, [], "t")):
        imports = specaudit_imports(source)
        assert imports, source
        wrong = [(module, name) for module, name in imports if module != "specaudit" or name not in specaudit.__all__]
        assert not wrong, wrong


def test_every_deprecation_is_dated_with_its_removal_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each old path has (date deprecated, release that removes it), and its warning says both."""
    assert set(DEPRECATIONS) == set(MODULES) | set(NAMES), set(DEPRECATIONS) ^ (set(MODULES) | set(NAMES))
    for since, removed in DEPRECATIONS.values():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", since) and removed == REMOVED_IN, (since, removed)
    fresh(monkeypatch, "specaudit.case")
    with pytest.warns(DeprecationWarning, match=rf"deprecated since 2026-12-02, removed in specaudit {REMOVED_IN}"):
        importlib.import_module("specaudit.case")
    with pytest.warns(DeprecationWarning, match=rf"deprecated since 2026-12-04, removed in specaudit {REMOVED_IN}"):
        importlib.import_module("specaudit.artifacts.reproducer").remember_failure  # noqa: B018


@pytest.mark.parametrize(
    "old",
    [
        "specaudit.artifacts.audit",
        "specaudit.artifacts.gate",
        "specaudit.artifacts.transplant",
        "specaudit.adapters.realaudit",
        *(f"specaudit.adapters.vllm_{m}" for m in ("drafts", "lifecycle", "metrics", "models")),
        *(f"specaudit.adapters.vllm_{m}" for m in ("observer", "report", "server", "whitebox")),
    ],
)
def test_shims_only_internal_moves_created_are_gone(old: str) -> None:
    """The audit's, the gate's, the transplant's and the real-model audit's old paths (issue 26, internal),
    and vLLM's flat modules, now the `specaudit.adapters.vllm` package (issue 39)."""
    assert old not in MODULES
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


@pytest.mark.parametrize(
    ("module", "name"),
    [("specaudit.contracts.decoder", "Watchdog"), ("specaudit.adapters.vllm.server", "Server")],
)
def test_names_only_internal_moves_created_are_gone(module: str, name: str) -> None:
    assert f"{module}.{name}" not in NAMES
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(module), name)
