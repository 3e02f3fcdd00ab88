"""What a fresh clone needs is in the clone (issue 38, point 8): `make cycles` runs a tool kept in the
repository, and `make audit` writes report.json and the reproducers somewhere it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "import_cycles.py"


def recipe(target: str) -> str:
    """The Makefile's recipe lines of `target`."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M)
    assert match, f"no target {target} in the Makefile"
    return match.group(1)


def test_make_cycles_uses_nothing_outside_the_repository() -> None:
    """The recipe names the tool in tools/, no path above the checkout."""
    commands = recipe("cycles")
    assert "tools/import_cycles.py" in commands and "../" not in commands, commands
    assert TOOL.is_file()


def test_the_cycle_tool_finds_a_cycle_and_passes_a_tree_without_one(tmp_path: Path) -> None:
    """A planted cycle through an import inside a function exits 1 and is named; removing it exits 0."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    found = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "pkg"], capture_output=True, text=True)
    assert found.returncode == 1 and "cycle: pkg.a <-> pkg.b" in found.stdout, found.stdout
    (pkg / "b.py").write_text("def f():\n    return 1\n")
    clean = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "pkg"], capture_output=True, text=True)
    assert clean.returncode == 0 and "0 import cycle(s)" in clean.stdout, clean.stdout


def test_make_audit_writes_its_report_and_reproducers() -> None:
    """`make audit` passes --out, so report.json and DIR/repro/ exist after it (README says where)."""
    commands = recipe("audit")
    assert "--out $(AUDIT_OUT)" in commands, commands
    out = re.search(r"^AUDIT_OUT \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert out and out.group(1) in (ROOT / "README.md").read_text(), "README must say where make audit writes"
