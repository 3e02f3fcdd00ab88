"""The layers of docs/design.md, kept: no module imports from a layer above its own.

Evidence flows one way, from the models up through running and checks to the artifacts (formats),
search, the adapters, the audits that drive them all, and the commands; a module that reaches
upward (imports inside functions included) would let a lower concern depend on how results are
reported or driven. Every module must be placed: a new one without a layer fails here until it
is given one. The artifacts are formats only: besides the layers, they import nothing from
search, running or the adapters (`ARTIFACTS_NEVER_IMPORT`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import specaudit
from specaudit._moved import MODULES

ROOT = Path(specaudit.__file__).parent
FOLDERS = {"": ROOT, **{name: ROOT.parent / name for name in ("reference", "fixtures", "properties")}}
"""The wheel's layout (see pyproject.toml): harness/ is specaudit, the other folders its subpackages."""

LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (layer, frozenset(names.split()))
    for layer, names in (
        ("foundation", "contracts _moved"),
        ("settings", "config"),
        ("models", "models reference fixtures"),
        ("numerics", "numerics"),
        ("running and observing", "running"),
        ("checks", "checks"),
        ("artifacts (formats)", "artifacts"),
        ("search and minimization", "search"),
        ("fleet: shards merged, Ray tasks", "fleet"),
        ("adapters", "adapters"),
        ("audits", "audits"),
        ("commands", "commands __main__ properties"),
        ("public API", " ".join(["__init__", *(old.removeprefix("specaudit.") for old in MODULES)])),
    )
)
"""Lowest first. A name is a module or a whole subpackage; the longest matching name wins.

The package root (`specaudit/__init__.py`) is the top layer, not the foundation. Every import of
any module runs it first, so it imports nothing at import time; but its module `__getattr__`
(PEP 562) imports each public name of `specaudit.__all__` from its home on first use, which
reaches into every layer, commands included. Placing it at the top says so, and keeps the rule
exact the other way: no module of the package may import from the root (`from specaudit import
Case`), which would tie a lower layer to the whole public API and to import cycles through it.
The old paths of moved modules (`specaudit.compat`, ..., `specaudit._moved.MODULES`) forward to
any layer too and sit beside the root; `_moved` itself, the forwarding, is standard library only."""


def modules() -> Iterator[tuple[str, Path]]:
    """(dotted name under specaudit, file) for every module of the package, subpackages included."""
    for prefix, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [*([prefix] if prefix else []), *path.relative_to(folder).with_suffix("").parts]
            if len(parts) > 1 and parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[0]:
                    best = (len(name), index)
    return None if best is None else best[1]


def imported(path: Path) -> Iterator[tuple[str, int]]:
    """(module under specaudit, line) for every specaudit import in a file, at any depth;
    `from specaudit import X` is X itself when X is a module, else a name of the root `__init__`."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "specaudit":
            yield from ((root_name(alias.name), node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specaudit."):
            base = node.module.removeprefix("specaudit.")
            yield from ((f"{base}.{alias.name}", node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (
                (a.name.removeprefix("specaudit."), node.lineno) for a in node.names if a.name.startswith("specaudit.")
            )


def root_name(name: str) -> str:
    """What `from specaudit import name` imports: a module of the package, or a name of its root."""
    return name if layer_of(name) is not None else f"__init__.{name}"


def target_layer(name: str) -> int | None:
    """The layer of `a.b.c` imported as a module or as a name from module `a.b`."""
    return layer_of(name) if layer_of(name) is not None else layer_of(name.rpartition(".")[0])


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m, _ in modules() if layer_of(m) is None)
    assert not unplaced, f"modules with no layer in tests/test_layers.py LAYERS: {unplaced}"


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = []
    for module, path in modules():
        own = layer_of(module)
        for name, line in imported(path):
            layer = target_layer(name)
            if own is not None and layer is not None and layer > own:
                upward.append(f"{module} ({LAYERS[own][0]}) imports {name} ({LAYERS[layer][0]}) at line {line}")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The negative control: a foundation module importing the CLI is reported."""
    path = tmp_path / "errors.py"
    path.write_text("def f():\n    from specaudit.commands.cli import main\n")
    found = [(name, target_layer(name)) for name, _ in imported(path)]
    assert found == [("commands.cli.main", layer_index("commands"))] and layer_of("contracts.errors") == 0, found


def test_the_layer_check_sees_an_import_from_the_package_root(tmp_path: Path) -> None:
    """The negative control: a check importing a public name from `specaudit` reaches the top layer."""
    path = tmp_path / "check.py"
    path.write_text("from specaudit import Case, contracts\n")
    found = [(name, target_layer(name)) for name, _ in imported(path)]
    top, foundation = layer_index("public API"), layer_index("foundation")
    assert found == [("__init__.Case", top), ("contracts", foundation)] and top == len(LAYERS) - 1, found


MODEL_RUNNERS = frozenset(
    "greedy_oracle reference_kv call_model run_case run_batch judge_divergence calibrate instrument"
    " EngineSession".split()
)
"""What runs a model (or a decoder or engine on one). A check reads the run; the model runs it
needs are the run's to make (`Run.again`, `Run.oracle_from`, `Run.entries`, `Run.score_divergence`)."""


def model_runners(path: Path) -> Iterator[tuple[str, int]]:
    """(name, line) for each model-running name a module imports, at any depth; an import for
    type hints only (under `if TYPE_CHECKING:`) runs nothing."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hints = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and id(node) not in hints:
            yield from ((a.name, node.lineno) for a in node.names if a.name in MODEL_RUNNERS)


def test_checks_run_no_model() -> None:
    found = [
        f"{module} imports {name} at line {line}"
        for module, path in modules()
        if layer_of(module) == layer_index("checks")
        for name, line in model_runners(path)
    ]
    assert not found, "checks that run a model themselves (ask the run instead):\n" + "\n".join(found)


def test_the_model_run_check_sees_one(tmp_path: Path) -> None:
    """The negative control: a check importing the oracle is reported."""
    path = tmp_path / "check.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from specaudit.running.engine_session import EngineSession\n"
        "from specaudit.reference.oracle import greedy_oracle\n"
    )
    assert list(model_runners(path)) == [("greedy_oracle", 4)]


def layer_index(name: str) -> int:
    return next(i for i, (layer, _) in enumerate(LAYERS) if layer == name)


ARTIFACTS_NEVER_IMPORT = frozenset({"search", "running", "adapters"})
"""What the formats (reproducer envelope, report, JUnit, tables) may not import, at any depth and
for type hints too: a format that ran a model, a search or an engine could not be read back
without them. The layer order already says search and adapters; running sits below, so it is
named here."""


def format_reaches(path: Path) -> Iterator[tuple[str, int]]:
    """(imported name, line) for each import of a module under `ARTIFACTS_NEVER_IMPORT`."""
    for name, line in imported(path):
        if name.split(".")[0] in ARTIFACTS_NEVER_IMPORT:
            yield name, line


def test_the_artifacts_are_formats_only() -> None:
    found = [
        f"{module} imports {name} at line {line}"
        for module, path in modules()
        if layer_of(module) == layer_index("artifacts (formats)")
        for name, line in format_reaches(path)
    ]
    assert not found, "artifacts that reach search, running or an adapter (formats only):\n" + "\n".join(found)


def test_the_formats_check_sees_a_run(tmp_path: Path) -> None:
    """The negative control: a report module importing the runner (even for a hint) is reported,
    and an old path left at the root (`compat.py`, a forward, placed with the public API) is no layer's."""
    path = tmp_path / "report.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specaudit.running.runner import Run\n"
        "from specaudit.checks.coverage import Coverage\n"
    )
    assert list(format_reaches(path)) == [("running.runner.Run", 3)]
    assert layer_of("artifacts.report") == layer_index("artifacts (formats)")
    assert layer_of("compat") == layer_index("public API")


def test_the_layer_order() -> None:
    """foundation < settings < models < numerics < running < checks < artifacts < search < fleet
    < adapters < audits < commands < public API."""
    order = ["contracts", "config", "models", "numerics", "running", "checks", "artifacts", "search", "fleet"]
    order += ["adapters"]
    order += ["audits", "commands", "__init__"]
    assert [layer_of(name) for name in order] == list(range(len(LAYERS))), [layer_of(name) for name in order]
