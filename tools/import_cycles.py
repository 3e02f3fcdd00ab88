"""Find import cycles among a project's own modules, counting imports inside functions too (`make cycles`).

usage: python import_cycles.py ROOT PKG [PKG...]   (prints each cycle; exit 1 if any)
"""

import ast
import sys
from pathlib import Path


def modules(root: Path, pkgs: list[str]) -> dict[str, Path]:
    found = {}
    for pkg in pkgs:
        base = root / pkg
        for path in base.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    out = set()
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                out.add(t)
    return out


def main() -> int:
    root = Path(sys.argv[1])
    known = modules(root, sys.argv[2:])
    graph = {m: imports(m, p, known) for m, p in known.items()}
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    for c in sccs:
        print("cycle:", " <-> ".join(c))
    print(f"{len(known)} modules, {len(sccs)} import cycle(s)")
    return 1 if sccs else 0


if __name__ == "__main__":
    sys.exit(main())
