"""Known-failures files: validated on load (a misspelled model, check, rule or decoder spec is a usage
error naming `file:line`, not an entry that silently matches nothing), and the entries no
failure matched are listed at the end of `specaudit audit`, `specaudit gate` and the pytest
suite (under pytest-xdist too), without changing the exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specaudit.commands.cli import main
from specaudit.config.xfails import KnownFailures, load_xfails
from specaudit.contracts.errors import UsageError

WRONG = "tests.decoders.wrong_token:WrongLastToken"  # fails equivalence, and only it, on every case
WRONG_TOO = "tests.decoders.wrong_token:WrongLastTokenToo"
FREE_LIST = "specaudit.reference.engine_mutants:FreeListOffByOne"  # fails contract has-unfinished in about a second


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "known.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def load_error(tmp_path: Path, *lines: str) -> str:
    with pytest.raises(UsageError) as caught:
        load_xfails(write(tmp_path, *lines))
    return str(caught.value)


# ---------------------------------------------------------------------------------------
# Validation on load


VALID = (
    "# decoder model check rule",
    "specaudit.reference.eqspec:EqSpec gpt2 I2 row-identity  # the row-binding false alarm",
    "specaudit.reference.mutants:* transparent * *",
    "* * I* *",
    "*mutants* llama I2 attends-*",
    "tests.decoders.wrong_token:WrongLastToken transparent equivalence first-divergence",
    "specaudit.reference.engines:EqSpecEngine qwen3 contract has-unfinished",
    "",
)


def test_valid_entries_load_and_start_unused(tmp_path: Path) -> None:
    """Full names, `*` in any field, partial wildcards that match a known name, comments: each
    entry loads, and until something matches it each is listed as matching nothing."""
    path = write(tmp_path, *VALID)
    lines = load_xfails(path).unused_lines()
    assert [line.split(": entry")[0] for line in lines] == [f"{path}:{n}" for n in range(2, 8)], lines
    assert lines[1] == f"{path}:3: entry matched no failure (specaudit.reference.mutants:* transparent * *)"


@pytest.mark.parametrize(
    ("line", "found", "should"),
    [
        (
            "specaudit.reference.eqspec:EqSpec gpt2 I-2 row-identity",
            "unknown check 'I-2'",
            "should be one of contract, I1",
        ),
        ("* * X* *", "unknown check 'X*'", "distribution or *"),
        ("* * I2 attends-wrong", "unknown rule 'attends-wrong' for check I2", "should be one of attends-wrong-slot"),
        ("* * I1 row-identity", "unknown rule 'row-identity' for check I1", "row-attends-nothing"),
        ("* * I* zzz*", "unknown rule 'zzz*' for checks I*", "input-token"),
        ("* * * no-such-rule", "unknown rule 'no-such-rule' for checks *", "first-divergence"),
        ("EqSpec gpt2 I2 *", "decoder 'EqSpec' is not a decoder spec", "should be module:attr"),
        ("specaudit.reference.eqspec: gpt2 I2 *", "is not a decoder spec", "specaudit.reference.mutants:*"),
        ("specaudit.reference.eqspec:EqSpec gtp2 I2 *", "unknown model 'gtp2'", "transparent, llama, qwen3, gpt2 or *"),
        ("* Llama * *", "unknown model 'Llama'", "should be one of transparent"),  # names match case-sensitively
        ("* smollm2 * *", "unknown model 'smollm2'", "gpt2 or *"),  # real-model mode takes no --xfails
        ("* x* * *", "unknown model 'x*'", "gpt2 or *"),  # a partial wildcard matching no model
    ],
)
def test_unknown_names_are_usage_errors(tmp_path: Path, line: str, found: str, should: str) -> None:
    """One line naming the file and line, what was found and what it should be."""
    message = load_error(tmp_path, "# header", line)
    assert message.startswith(f"{tmp_path / 'known.txt'}:2: "), message
    assert found in message and should in message and "\n" not in message, message


def test_every_built_in_model_and_wildcard_loads(tmp_path: Path) -> None:
    """No false rejection: each built-in model, `*` and a partial wildcard that matches one load,
    and each entry matches a violation on the model it names."""
    from specaudit.contracts.builtins import MODELS

    known = load_xfails(write(tmp_path, *(f"* {model} I2 *" for model in (*MODELS, "*", "q*", "*t*"))))
    assert [e.model for e in known.entries] == [*MODELS, "*", "q*", "*t*"]
    for model in MODELS:
        assert known.matches("mypkg:Dec", model, "I2", "row-identity"), model


def test_documented_examples_load(tmp_path: Path) -> None:
    """The known-failures examples in docs/decoders.md and docs/gate.md are files a user may copy: they load."""
    root = Path(__file__).resolve().parents[2]
    for doc in ("docs/decoders.md", "docs/gate.md"):
        blocks = [b.split("```", 1)[0] for b in (root / doc).read_text(encoding="utf-8").split("```text\n")[1:]]
        examples = [b for b in blocks if b.lstrip().startswith("# decoder")]
        assert examples, f"{doc} shows no known-failures example"
        for n, block in enumerate(examples):
            (tmp_path / f"{n}.txt").write_text(block, encoding="utf-8")  # indented lines split alike
            assert len(load_xfails(tmp_path / f"{n}.txt")) >= 2, (doc, block)


def test_validation_stays_torch_free(tmp_path: Path) -> None:
    """The CLI and the plugin validate a file before anything heavy is imported."""
    path = write(tmp_path, "* * I-2 *")
    code = (
        "import sys\nfrom specaudit.contracts.errors import UsageError\n"
        "from specaudit.config.xfails import load_xfails\n"
        f"try:\n    load_xfails({str(path)!r})\nexcept UsageError:\n    sys.exit('torch' in sys.modules)\n"
        "sys.exit(2)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---------------------------------------------------------------------------------------
# Used and unused entries


def test_every_matching_entry_is_marked_used(tmp_path: Path) -> None:
    """Two entries covering one violation are both used; the one matching nothing is listed."""
    known = load_xfails(write(tmp_path, "* transparent I2 *", "*:EqSpec * I2 row-identity", "* llama * *"))
    assert known.matches("specaudit.reference.eqspec:EqSpec", "transparent", "I2", "row-identity")
    assert not known.matches("specaudit.reference.eqspec:EqSpec", "gpt2", "I1", "mask-shape")
    assert known.unused_lines() == [f"{tmp_path / 'known.txt'}:3: entry matched no failure (* llama * *)"]


def test_entries_used_elsewhere_are_folded_in(tmp_path: Path) -> None:
    """What a worker process saw matching (indices into the same file) counts as used here."""
    known = load_xfails(write(tmp_path, "* transparent I2 *", "* llama * *"))
    known.mark_used([1, 7])  # an index past the file is ignored
    assert [e.source.rsplit(":", 1)[1] for e in known.unused()] == ["1"]
    assert KnownFailures().unused_lines() == []


# ---------------------------------------------------------------------------------------
# The commands


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specaudit: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["audit", "gate"])
def test_cli_refuses_an_unknown_check(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "* * I2 *", "specaudit.reference.eqspec:EqSpec gpt2 I-2 row-identity")
    assert main([command, "--xfails", str(path), "--models", "transparent", "--quiet"]) == 2
    assert f"{path}:2: unknown check 'I-2'" in one_error_line(capsys)


def test_audit_lists_unused_entries_at_the_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The decoder's failures are all listed, so it passes (exit 0); the llama entry matched nothing."""
    path = write(tmp_path, f"{WRONG} transparent equivalence *", f"{WRONG} llama * *")
    argv = ["audit", "--decoder", WRONG, "--models", "transparent", "--examples", "3", "--quiet"]
    assert main([*argv, "--xfails", str(path)]) == 0
    out = capsys.readouterr().out
    assert "known failures met: equivalence first-divergence" in out, out
    assert out.rstrip().splitlines()[-1] == f"{path}:2: entry matched no failure ({WRONG} llama * *)", out
    assert f"{path}:1:" not in out


def test_audit_known_engine_failure_is_xfail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An engine whose every violation is listed passes as a known failure (XFAIL)."""
    path = write(tmp_path, f"{FREE_LIST} transparent contract has-unfinished", f"{FREE_LIST} * I2 *")
    argv = ["audit", "--engine", FREE_LIST, "--models", "transparent", "--examples", "10", "--quiet"]
    assert main([*argv, "--xfails", str(path)]) == 0
    out = capsys.readouterr().out
    assert "XFAIL" in out and "known failures met: contract has-unfinished" in out, out
    assert out.rstrip().splitlines()[-1] == f"{path}:2: entry matched no failure ({FREE_LIST} * I2 *)", out


def test_gate_lists_unused_entries_at_the_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Known failures only: the gate passes, and lists the entry that matched nothing last."""
    path = write(tmp_path, f"{WRONG} transparent * *", f"{WRONG} transparent I2 *")
    argv = ["gate", "--decoder", WRONG, "--models", "transparent", "--examples", "3", "--quiet"]
    argv += ["--junit", str(tmp_path / "junit.xml"), "--out", str(tmp_path / "out"), "--xfails", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gate PASSED" in out and "1 known failure(s)" in out, out
    assert out.rstrip().splitlines()[-1] == f"{path}:2: entry matched no failure ({WRONG} transparent I2 *)", out


# ---------------------------------------------------------------------------------------
# The pytest plugin

SUITE = """
import pytest

from specaudit.contracts.case import Case
from specaudit.checks.registry import all_violations
from specaudit.commands.pytest_notes import remember_failure
from specaudit.running.runner import run_case

pytestmark = pytest.mark.specaudit
CASE = Case(((3, 4, 5), (6, 7)), ("1101", "0110"), 2, 4, None, 0)


def test_outputs(specaudit_decoder: str, specaudit_model: str, request: pytest.FixtureRequest) -> None:
    run = run_case(specaudit_decoder, CASE)
    violations = all_violations(run)
    if violations:
        remember_failure(run, violations, request.node)
    assert not violations, violations[0].render()
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("CI", raising=False)
    paths = [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))  # the test decoders in tests/decoders
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_plugin_refuses_an_unknown_rule(suite: pytest.Pytester) -> None:
    known = suite.makefile(".txt", known=f"{WRONG} transparent equivalence first-divergance\n")
    result = suite.runpytest_subprocess("--specaudit-xfails", str(known))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert f"{known}:1: unknown rule 'first-divergance' for check equivalence" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["in-process", "xdist"])
def test_plugin_lists_unused_entries_in_the_summary(suite: pytest.Pytester, workers: list[str]) -> None:
    """Both decoders' failures are xfailed by their own entries (under xdist each worker tells the
    controller what it used); only the third entry, matching nothing, is listed."""
    known = suite.makefile(
        ".txt", known=f"{WRONG} transparent * *\n{WRONG_TOO} transparent equivalence *\n{WRONG} llama * *\n"
    )
    decoders = ["--specaudit-decoder", WRONG, "--specaudit-decoder", WRONG_TOO]
    result = suite.runpytest_subprocess(
        *workers, *decoders, "--specaudit-models", "transparent", "--specaudit-xfails", str(known), "-rx"
    )
    out = result.stdout.str()
    assert result.ret == 0 and result.parseoutcomes().get("xfailed") == 2, out
    result.stdout.fnmatch_lines(["*known failures that matched nothing*", f"{known}:3: entry matched no failure *"])
    assert f"{known}:1: entry" not in out and f"{known}:2: entry" not in out, out


def test_old_engine_liveness_rule_names_still_mean_the_same(tmp_path: Path) -> None:
    """Engine liveness once had rules of its own ('wait-bound', 'finishes'); now a decoder's
    names serve both, and a file written with the old names still marks the same violations."""
    path = write(tmp_path, "mypkg:Engine * liveness wait-bound\nmypkg:Engine * liveness finishes")
    known = load_xfails(path)
    for rule in ("bounded-queue", "bounded-wait", "request-finishes"):
        assert known.matches("mypkg:Engine", "transparent", "liveness", rule), rule
    assert not known.matches("mypkg:Engine", "transparent", "equivalence", "first-divergence")
