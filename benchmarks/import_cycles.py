"""The package's import graph and its cycles, every import counted (those inside functions too).

    python benchmarks/import_cycles.py [--edges]

Modules are found through pyproject.toml's package-dir mapping (moebench = harness/, moebench.engine
= engine/, ...), which is also why import-linter cannot read this tree as it lies: tests/
test_architecture.py lays the package out as installed before running it. An import of
`pkg.name` where `pkg/name.py` exists counts as an import of that module, else of `pkg`, as
grimp (import-linter's graph) counts it; imports under `if TYPE_CHECKING:` never run and are left
out. A cycle is a strongly connected component of more than one module; --edges lists the imports
inside each, with their lines.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, over every package pyproject.toml lists."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping, modules = tool["package-dir"], {}
    for package in tool["packages"]:
        # a package's folder: its own mapping, else its parent's folder plus its last name
        parts, folder = package.split("."), None
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in mapping:
                folder = root / mapping[prefix] / Path(*parts[i:])
                break
        if folder is None or not folder.is_dir():
            continue
        for f in sorted(folder.glob("*.py")):
            modules[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    return modules


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (never run; import-linter is told to skip them too)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports(modules: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """module -> {imported module of the package: [lines]}."""
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.stem == "__init__"
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, module, is_package)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].setdefault(target, []).append(node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out, key=lambda c: (-len(c), c))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edges", action="store_true", help="list the imports inside each cycle")
    args = ap.parse_args(argv)
    modules = package_files()
    graph = imports(modules)
    found = cycles(graph)
    edges = sum(len(targets) for targets in graph.values())
    print(f"{len(modules)} modules, {edges} imports between them, {len(found)} import cycles")
    for component in found:
        print(f"- {len(component)} modules: {', '.join(component)}")
        if args.edges:
            members = set(component)
            for module in component:
                for target, lines in sorted(graph[module].items()):
                    if target in members:
                        print(f"    {module} -> {target} (line {', '.join(map(str, lines))})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
