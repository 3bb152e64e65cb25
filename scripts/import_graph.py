#!/usr/bin/env python3
"""Print opd's import graph and check its two rules (docs/architecture.md, Layout).

    python scripts/import_graph.py            # package edges, then module cycles
    python scripts/import_graph.py --modules  # every module -> module edge inside opd
    python scripts/import_graph.py --check    # exit 1 when a rule is broken

Rules: a tool package (opd_rollout, opd_score, opd_train, opd_eval, opd_publish, opd_check) imports opd_common and
nothing of another tool; opd_common imports no tool; no two modules import each other, directly or
around a longer circle. Every import counts, also those inside functions (where opd puts its heavy
ones), since a circle through a function-level import is still a circle a reader has to hold in mind.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "libs" / "common", *sorted((ROOT / "tools").glob("*"))]
COMMON = "opd_common"


def modules(sources: list[Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the opd_* packages under `sources`."""
    found = {}
    for base in sources:
        for path in sorted(base.glob("opd_*/**/*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The opd modules that module `name` imports (a `from pkg import mod` of a submodule counts as mod)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, name, is_package)
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph(sources: list[Path] = SOURCES) -> dict[str, set[str]]:
    """Module -> the opd modules it imports."""
    known = modules(sources)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def package(module: str) -> str:
    return module.split(".")[0]


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out = defaultdict(set)
    for src, targets in edges.items():
        for dst in targets:
            if package(src) != package(dst):
                out[package(src)].add(package(dst))
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def violations(edges: dict[str, set[str]]) -> list[str]:
    """One line per broken rule."""
    out = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            a, b = package(src), package(dst)
            if a != b and b != COMMON:
                out.append(f"{src} imports {dst}: a tool imports only {COMMON} (move the shared piece there)")
    for component in cycles(edges):
        out.append("import circle: " + " <-> ".join(component) + " (make the dependency go one way)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="print every module edge")
    parser.add_argument("--check", action="store_true", help="exit 1 when a rule is broken")
    args = parser.parse_args(argv)
    edges = graph()
    if args.modules:
        for src, targets in sorted(edges.items()):
            for dst in sorted(targets):
                print(f"{src} -> {dst}")
    else:
        for src, targets in sorted(package_edges(edges).items()):
            print(f"{src} -> {', '.join(sorted(targets))}")
    problems = violations(edges)
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print("ok: tools import only opd_common; no import circles", file=sys.stderr)
    return 1 if problems and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
