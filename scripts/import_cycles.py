"""Find import cycles among pagedllm's modules: `python scripts/import_cycles.py` (exit 1 if any).

Every `import` / `from ... import` of a pagedllm module counts, at module level and under
`if TYPE_CHECKING:` alike: a type-only import is still a dependency, and a circle of them means two
modules that cannot be read (or split) apart. Imports inside functions (deferred on purpose: an
optional dependency, a backend chosen at run time) are left out unless `--include-local` is given.

`from pagedllm.a import b` is an edge to `pagedllm.a.b` when that is a module, else to `pagedllm.a`.
Importing `pagedllm.a.b` also runs `pagedllm/a/__init__.py`, but that implicit edge is not counted:
a package's `__init__` importing its own submodules is not a cycle worth reporting.

Prints each cycle once (its strongly connected component and one cycle through it) as
`a -> b -> a`, and the totals last.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "pagedllm"


def module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, include_local: bool) -> list[ast.Import | ast.ImportFrom]:
    """Module-level imports, those under `if TYPE_CHECKING:` (and try/except blocks at module level),
    and with include_local every other one too."""
    if include_local:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                found.append(s)
            elif isinstance(s, ast.If):
                visit(s.body)
                visit(s.orelse)
            elif isinstance(s, ast.Try):
                visit(s.body)
                for h in s.handlers:
                    visit(h.body)
                visit(s.orelse)
                visit(s.finalbody)

    visit(tree.body)
    return found


def import_graph(root: Path, include_local: bool = False) -> dict[str, set[str]]:
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree, include_local):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the containing package, up level - 1
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                # `import pagedllm.a.b.c` where only pagedllm.a.b is a module file: take the longest known.
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith(PACKAGE):
                    graph[name].add(t)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module (self-imports are skipped)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    members = set(component)
    start = component[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if nxt not in prev:
                    prev[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError("a strongly connected component without a cycle")


def find_cycles(root: Path = ROOT, include_local: bool = False) -> list[list[str]]:
    graph = import_graph(root, include_local)
    return [one_cycle(graph, comp) for comp in strongly_connected(graph)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--include-local", action="store_true", help="count imports inside functions too")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository root (holds pagedllm/)")
    args = ap.parse_args(argv)
    cycles = find_cycles(args.root, args.include_local)
    for c in cycles:
        print(" -> ".join(c))
    n = len(module_names(args.root))
    print(f"{len(cycles)} import cycle(s) among {n} modules" + (" (function-local imports counted)"
                                                                 if args.include_local else ""))
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
