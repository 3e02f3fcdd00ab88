"""JUnit XML: one <testsuite> of testcases, each with its properties, its failure or its xfail,
and the reproducers it left.

A format only: what a testcase holds (its properties, why it fails) is decided by its writer
(`specaudit.audits.gate`, from the verdicts' report entries); this module lays it out as CI
tools read it.
"""

from __future__ import annotations

import socket
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Failure:
    """Why a testcase fails: the JUnit failure's type, message and body."""

    kind: str
    message: str
    details: str


@dataclass(frozen=True)
class Testcase:
    """One testcase: `xfail` is the message of a skipped testcase of type xfail (known failures only)."""

    classname: str
    name: str
    seconds: float
    properties: dict[str, str]
    failure: Failure | None = None
    xfail: str | None = None
    reproducers: tuple[Path, ...] = ()
    notes: tuple[str, ...] = ()  # lines for its system-out (a passing verdict's efficiency findings)


def junit_document(title: str, suite: str, cases: list[Testcase], properties: dict[str, str]) -> ET.ElementTree:
    """<testsuites name=`title`> holding one <testsuite name=`suite`> with the suite's properties
    and `cases`, counted (tests, failures, skipped) and timed (the sum of the cases)."""
    counts = {"tests": str(len(cases)), "failures": str(sum(c.failure is not None for c in cases)), "errors": "0"}
    counts["skipped"] = str(sum(c.failure is None and c.xfail is not None for c in cases))
    total = f"{sum(c.seconds for c in cases):.3f}"
    suites = ET.Element("testsuites", name=title, **counts, time=total)
    element = ET.SubElement(
        suites,
        "testsuite",
        name=suite,
        **counts,
        time=total,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
        hostname=socket.gethostname(),
    )
    props = ET.SubElement(element, "properties")
    for name, value in properties.items():
        ET.SubElement(props, "property", name=name, value=value)
    for case in cases:
        testcase(element, case)
    ET.indent(suites)
    return ET.ElementTree(suites)


def testcase(suite: ET.Element, case: Testcase) -> None:
    """One testcase: its properties, then its failure or its xfail, then its reproducers."""
    element = ET.SubElement(suite, "testcase", classname=case.classname, name=case.name, time=f"{case.seconds:.3f}")
    props = ET.SubElement(element, "properties")
    for key, value in case.properties.items():
        ET.SubElement(props, "property", name=key, value=value)
    if case.failure is not None:
        failure = ET.SubElement(element, "failure", message=case.failure.message, type=case.failure.kind)
        failure.text = case.failure.details
    elif case.xfail is not None:
        ET.SubElement(element, "skipped", type="xfail", message=case.xfail)
    if case.reproducers or case.notes:
        out = ET.SubElement(element, "system-out")
        out.text = "\n".join([*case.notes, *(f"reproducer written to {path}" for path in case.reproducers)])


def write_junit(path: Path, tree: ET.ElementTree) -> None:
    """The document at `path`, its folder made (an OSError is the caller's to word)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tree.write(path, encoding="utf-8", xml_declaration=True)


__all__ = ["Failure", "Testcase", "junit_document", "write_junit"]
