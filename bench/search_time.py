"""One planted bug's whole search (find, Hypothesis shrink, delta debugging) and 50 examples of
EQSPEC's search on the transparent model, timed in one process: the unit of work the catalog
tests, the conformance suite and `make audit` repeat. Run it on two trees to compare them.

    python bench/search_time.py [--bug bonus_window_of_three]
"""

from __future__ import annotations

import argparse
import time

import torch

from specaudit.audits.decoders import PLANTED_SHRINK_BUDGET
from specaudit.reference.mutants import CATALOG
from specaudit.search.driver import search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", default="bonus_window_of_three")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bug = CATALOG[args.bug].bug
    start = time.perf_counter()
    found = search(f"specaudit.reference.mutants:{args.bug}", bug.models[0], max_examples=200, seed=0,
                   shrink_budget=PLANTED_SHRINK_BUDGET, minimize_budget=PLANTED_SHRINK_BUDGET)  # fmt: skip
    rows = found.minimal.batch_size if found.minimal else None
    print(f"{args.bug}: {time.perf_counter() - start:.2f} s, found after {found.examples} examples, {rows} row(s)")
    start = time.perf_counter()
    passed = search("specaudit.reference.eqspec:EqSpec", "transparent", max_examples=50, seed=0).minimal is None
    print(f"EqSpec, 50 examples: {time.perf_counter() - start:.2f} s, passed {passed}")


if __name__ == "__main__":
    main()
