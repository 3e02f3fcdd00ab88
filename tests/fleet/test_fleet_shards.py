"""`--shard i/n` and `specaudit merge` on written shard reports: the split is stable and
complete, and the merge joins complete shards in plan order and refuses every incomplete set."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specaudit.artifacts.report import load_report, write_report
from specaudit.audits.plan import plan_cells, shard_items, shard_record
from specaudit.audits.subject import Item
from specaudit.config.shards import Shard, cell_id, cell_ids, parse_shard, shard_of
from specaudit.contracts.errors import UsageError
from specaudit.fleet.merge import run_merge

PLAN = [Item(f"pkg.mod:Decoder{i}", model, False, 5, 0) for i in range(6) for model in ("transparent", "llama")]


def test_shard_parses_one_based_i_of_n() -> None:
    """`I/N` with 1 <= I <= N parses; anything else is a usage error naming it."""
    assert parse_shard("2/4") == Shard(2, 4)
    assert parse_shard(" 1 / 1 ") == Shard(1, 1)
    for bad in ("0/4", "5/4", "1/0", "a/b", "1-4", "3"):
        with pytest.raises(UsageError, match="--shard"):
            parse_shard(bad)


def test_a_cells_shard_is_a_fixed_function_of_its_name() -> None:
    """The hash is SHA-256, not Python's salted hash(): pinned values, so every machine of a CI
    matrix and every later version splits a plan alike."""
    cell = cell_id("decoder", "specaudit.reference.eqspec:EqSpec", "transparent")
    assert cell == "decoder:specaudit.reference.eqspec:EqSpec@transparent"
    assert [shard_of(cell, n) for n in (1, 2, 3, 4, 8)] == [1, 2, 2, 2, 2]


def test_the_shards_partition_the_plan() -> None:
    """Every cell runs in exactly one of the N shards, each shard in plan order."""
    for count in (1, 2, 3, 4):
        shards = [shard_items(PLAN, Shard(i, count)) for i in range(1, count + 1)]
        assert sorted(PLAN.index(item) for items in shards for item in items) == list(range(len(PLAN)))
        for items in shards:
            assert [PLAN.index(item) for item in items] == sorted(PLAN.index(item) for item in items)


def test_adding_a_cell_moves_no_other_cell() -> None:
    """A new subject in the plan lands in some shard; every other cell stays where it was."""
    before = {cell: shard_of(cell, 4) for cell in plan_cells(PLAN)}
    grown = [Item("pkg.mod:NewDecoder", "qwen3", False, 5, 0), *PLAN]
    after = {cell: shard_of(cell, 4) for cell in plan_cells(grown)}
    assert all(after[cell] == shard for cell, shard in before.items())


def test_a_subject_planned_twice_gets_two_cells() -> None:
    """Two items with one name are two cells (`#2`), so the merge can place both."""
    assert cell_ids([("decoder", "m:X", "gpt2")] * 2) == ["decoder:m:X@gpt2", "decoder:m:X@gpt2#2"]


# ---------------------------------------------------------------------------------------
# The merge, on shard reports written as the audit writes them


def entry(item: Item, passed: bool = True) -> dict:
    return {"kind": "decoder", "subject": {"decoder": item.spec, "model": item.model}, "passed": passed}


def write_shards(root: Path, count: int, failing: set[int] = frozenset()) -> list[Path]:
    """The audit's --out of each shard of PLAN: report.json with its record, a reproducer per
    failing cell (cells whose plan index is in `failing`)."""
    dirs = []
    for index in range(1, count + 1):
        shard = Shard(index, count)
        items = shard_items(PLAN, shard)
        bad = [item for item in items if PLAN.index(item) in failing]
        directory = root / f"shard{index}"
        entries = [entry(item, item not in bad) for item in items]
        write_report(directory, "audit", entries, shard=shard_record(PLAN, shard), exit=int(bool(bad)))
        for item in bad:
            (directory / "repro").mkdir(exist_ok=True)
            (directory / "repro" / f"{item.spec.split(':')[1]}_{item.model}.json").write_text("{}\n")
        dirs.append(directory)
    return dirs


def test_complete_shards_merge_in_plan_order(tmp_path: Path) -> None:
    """Four passing shards merge to exit 0 with every entry, in the plan's order."""
    dirs = write_shards(tmp_path, 4)
    assert run_merge(dirs[::-1], tmp_path / "merged") == 0
    merged = load_report(tmp_path / "merged" / "report.json")
    assert [(e["subject"]["decoder"], e["subject"]["model"]) for e in merged["entries"]] == [
        (item.spec, item.model) for item in PLAN
    ]
    assert merged["passed"] and merged["exit"] == 0 and merged["merged"]["count"] == 4


def test_a_failed_shard_fails_the_merge_and_its_reproducers_travel(tmp_path: Path) -> None:
    """A shard that exited 1 makes the merge exit 1; its reproducers are copied under OUT."""
    dirs = write_shards(tmp_path, 3, failing={5})
    assert run_merge(dirs, tmp_path / "merged") == 1
    assert [p.name for p in (tmp_path / "merged" / "repro").iterdir()] == ["Decoder2_llama.json"]
    assert not load_report(tmp_path / "merged" / "report.json")["passed"]


def test_a_missing_shard_is_an_error(tmp_path: Path) -> None:
    """Three of four shards, or a shard directory with no report (killed before writing it): exit 2."""
    dirs = write_shards(tmp_path, 4)
    with pytest.raises(UsageError, match=r"shard\(s\) 3/4 missing"):
        run_merge([d for d in dirs if d.name != "shard3"], tmp_path / "merged")
    (dirs[1] / "report.json").unlink()
    with pytest.raises(UsageError, match="did not finish"):
        run_merge(dirs, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()  # nothing written from an incomplete set


def test_shards_of_other_plans_or_incomplete_ones_are_refused(tmp_path: Path) -> None:
    """A shard given twice, one of a plan run with another budget, and one with fewer entries than
    cells are each refused."""
    dirs = write_shards(tmp_path, 2)
    with pytest.raises(UsageError, match="more than once"):
        run_merge([dirs[0], dirs[0], dirs[1]], tmp_path / "m1")
    other = [Item(i.spec, i.model, False, 9, 0) for i in PLAN]  # --examples 9
    shard = Shard(2, 2)
    foreign = tmp_path / "foreign"
    entries = [entry(i) for i in shard_items(other, shard)]
    write_report(foreign, "audit", entries, shard=shard_record(other, shard), exit=0)
    with pytest.raises(UsageError, match="another plan"):
        run_merge([dirs[0], foreign], tmp_path / "m2")
    report = load_report(dirs[1] / "report.json")
    write_report(dirs[1], "audit", report["entries"][:-1], shard=report["shard"], exit=0)
    with pytest.raises(UsageError, match="incomplete"):
        run_merge(dirs, tmp_path / "m3")


def test_an_unsharded_report_is_not_a_shard(tmp_path: Path) -> None:
    """A report of a run without --shard says nothing of the plan: refused."""
    write_report(tmp_path / "whole", "audit", [entry(PLAN[0])])
    with pytest.raises(UsageError, match="not a shard's report"):
        run_merge([tmp_path / "whole"], tmp_path / "merged")


def test_the_flags_are_refused_where_they_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    """`--shard` without --out (no report to merge) and in real-model mode are usage errors (exit 2)."""
    from specaudit.commands.cli import main

    assert main(["audit", "--shard", "1/2", "--models", "transparent"]) == 2
    assert "--shard 1/2 needs --out" in capsys.readouterr().err
    assert main(["audit", "--target", "smollm2", "--shard", "1/2"]) == 2
    assert "--shard: built-in models only" in capsys.readouterr().err
    assert main(["gate", "--shard", "3/2"]) == 2
    assert "I must be in 1..N" in capsys.readouterr().err


def test_ray_missing_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--ray` without Ray installed says how to install it, before anything runs."""
    from specaudit.fleet import ray_sweep

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(UsageError, match=r"specaudit\[ray\]"):
        ray_sweep.run_all_ray(str, [1], lambda i, r: None)
