"""The wheel, as a user installs it: one import name, and the conformance suite shipped inside.

The wheel is built from this checkout and installed (no dependencies, not editable) into a fresh
virtual environment that borrows this one's third-party packages through a path file, so no
package is downloaded and this checkout's editable install is not visible there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds a wheel and installs it into fresh venvs

ROOT = Path(__file__).resolve().parents[2]
EQSPEC = "specaudit.reference.eqspec:EqSpec"
PLANTED = "specaudit.reference.mutants:rejected_kv_attended"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel and what its build printed. Built from a copy of the sources: a stale build/
    folder in the checkout must not leak into it."""
    source, out = tmp_path_factory.mktemp("source") / "specaudit", tmp_path_factory.mktemp("wheel")
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__", ".hypothesis", "specaudit-*")
    shutil.copytree(ROOT, source, ignore=skip)
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out)]
    done = subprocess.run([*build, str(source)], check=True, capture_output=True, text=True)
    (path,) = out.glob("specaudit-*.whl")
    return path, done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(built: tuple[Path, str]) -> Path:
    return built[0]


def test_wheel_builds_without_setuptools_warnings(built: tuple[Path, str]) -> None:
    """The packaging is what setuptools expects: a data folder missing from `packages` (shipped
    only through an ambiguous namespace package, so a future setuptools may drop it) warns here."""
    output = built[1]
    assert "BuildBackendWarning" not in output and "absent from the `packages`" not in output, output[-3000:]


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `bin` folder of a fresh venv holding the wheel (its dependencies borrowed from this venv)."""
    env = tmp_path_factory.mktemp("venv") / "env"
    venv.create(env, with_pip=False)
    site = next((env / "lib").glob("python*/site-packages"))
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = env / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    return env / "bin"


def test_wheel_holds_only_the_specaudit_import_name(wheel: Path) -> None:
    """Every file of the wheel lies under specaudit/ or its dist-info, and every source file is in it."""
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"specaudit", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    layout = {"harness": "specaudit", "reference": "specaudit/reference", "fixtures": "specaudit/fixtures"}
    layout["properties"] = "specaudit/properties"
    wanted = {"specaudit/models/data/prompts.jsonl"}
    for folder, prefix in layout.items():
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.relative_to(ROOT / folder)
            if relative.parts[0] not in layout and "__pycache__" not in relative.parts:
                wanted.add(f"{prefix}/{relative.as_posix()}")
    missing = sorted(wanted - set(names))
    assert not missing, f"source files missing from the wheel: {missing}"


def clean_env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def suite(bin_dir: Path, cwd: Path, decoder: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [str(bin_dir / "specaudit"), "suite", "--decoder", decoder, "--models", "transparent", "-x", "-q"]
    command += ["--hypothesis-profile", "specaudit-dev", *extra]
    return subprocess.run(command, cwd=cwd, env=clean_env(bin_dir), capture_output=True, text=True, timeout=600)


def test_installed_suite_is_the_wheels(installed: Path, tmp_path: Path) -> None:
    """The venv imports specaudit, its suite included, from the wheel's files, not from this checkout."""
    code = "import specaudit.properties as p; print(p.__file__)"
    where = subprocess.run(
        [str(installed / "python"), "-c", code], cwd=tmp_path, env=clean_env(installed), capture_output=True, text=True
    )
    assert where.stdout.startswith(str(installed.parent)), where.stdout + where.stderr


def test_installed_suite_passes_a_correct_decoder_and_fails_a_planted_one(installed: Path, tmp_path: Path) -> None:
    """From an empty directory, `specaudit suite` exits 0 for EqSpec and 1 for a planted bug, from the wheel."""
    good = suite(installed, tmp_path, EQSPEC)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-2000:]
    assert "PytestAssertRewriteWarning" not in good.stdout + good.stderr
    bad = suite(installed, tmp_path, PLANTED)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    assert "site-packages/specaudit/properties" in bad.stdout or "FAILED" in bad.stdout


def test_installed_suite_finds_a_decoder_beside_the_caller(installed: Path, tmp_path: Path) -> None:
    """`--decoder mymod:Attr` finds a module in the current directory, as `pytest` in a checkout would."""
    (tmp_path / "mydecoder.py").write_text("from specaudit.reference.eqspec import EqSpec as MyDecoder\n")
    result = suite(installed, tmp_path, "mydecoder:MyDecoder", "-k", "i1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
