"""Plants the vLLM bug named in $SPECAUDIT_VLLM_PLANTED in every process of a served vLLM that
imports its module (`bench/blackbox_failing.py --vllm-python`: this folder is put on the server's
PYTHONPATH). The patch is applied when vLLM imports the module, not at start-up, so processes
that never import it pay nothing."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

NAME = os.environ.get("SPECAUDIT_VLLM_PLANTED", "")
MODULE = os.environ.get("SPECAUDIT_VLLM_PLANTED_MODULE", "")


def plant() -> None:
    from specaudit.reference.vllm_mutants import BY_NAME, planted

    planted(BY_NAME[NAME]).__enter__()  # kept for the process's life
    print(f"specaudit: planted {NAME} in pid {os.getpid()}", file=sys.stderr, flush=True)


class PlantOnImport(importlib.abc.MetaPathFinder):
    """Finds `MODULE` with the other finders, and plants the bug once it has executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            plant()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if NAME and MODULE:
    sys.meta_path.insert(0, PlantOnImport())
