"""Import cycles between qllama's modules, counting imports inside functions (those under
`if TYPE_CHECKING:` aside). Prints each cycle; exit status 1 if there is any.

    python tools/import_cycles.py [--edges]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "qllama"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target not in mods:
                    continue
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in mods else target)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in mods)
        found.discard(name)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    graph = edges(modules())
    if "--edges" in sys.argv:
        for name in sorted(graph):
            print(name, "->", ", ".join(sorted(graph[name])))
    found = cycles(graph)
    for comp in found:
        print("cycle:", " <-> ".join(comp))
    if not found:
        print(f"no import cycle among {len(graph)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
