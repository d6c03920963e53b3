"""The package's floors (docs/architecture.md): every import of our own modules, at module top or inside a function,
points at the same floor or one below it; the module-top imports have no cycle, and function-level imports close
only the cycles listed here with their reason.

Parsed with ast, nothing imported, so it runs in a second and also covers the Transformer Engine modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "fp8_recipes"

# Bottom to top, as docs/architecture.md draws them; a module is on the floor of its longest matching prefix.
FLOORS: list[tuple[str, ...]] = [
    ("checks", "recipe.yaml_guard", "recipe.schema", "rundir", "launcher", "numerics"),  # 0: typed recipe, key checks, numerics, run dir, launcher env
    ("plan", "recipe"),                                                # 1: the PrecisionPlan and the recipe pack
    ("backends", "observe"),                                           # 2: executing and observing the plan
    ("megatron", "integrations.hf_llama"),                             # 3: Megatron-Core model, data; HF Llama layout
    ("training",),                                                     # 4: the run: config, engine, loop, checkpoints
    ("bench", "launch", "integrations", "cli"),                        # 5: entry points and framework adapters
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    best, floor = -1, None
    for i, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, floor = len(name), i
    assert floor is not None, f"{module}: on no floor; add it to FLOORS here and to docs/architecture.md"
    return floor


def _resolve(name: str) -> str | None:
    """The module of ours that `name` (a module or module.attribute) lives in, relative to the package."""
    parts = name.split(".")[1:]
    while parts:
        path = PACKAGE.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported module, line, at module top)] for every import of fp8_recipes."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module, tree = _module_name(path), ast.parse(path.read_text(), str(path))
        top = {id(node) for node in tree.body}
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ["fp8_recipes", *module.split(".")]
                    base = base[: len(base) - node.level + (path.name == "__init__.py")]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                names = [f"{prefix}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                target = _resolve(name) if name.startswith("fp8_recipes.") else None
                if target is not None and target != module and target:
                    found.append((target, node.lineno, id(node) in top))
        out[module] = found
    return out


def test_no_import_runs_upward():
    upward = [f"{module} (floor {_floor(module)}) line {line} imports {target} (floor {_floor(target)})"
              for module, found in _imports().items() if module
              for target, line, _ in found if _floor(target) > _floor(module)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


# Cycles that only a function-level import closes, each with its reason; a new one fails the test below.
KNOWN_LAZY_CYCLES: set[frozenset[str]] = set()  # none left; a new one needs its reason here


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_function_level_imports_close_only_the_known_cycles():
    graph = {m: {t for t, _, _ in found} for m, found in _imports().items()}
    new = [sorted(c) for c in _cycles(graph) if c not in KNOWN_LAZY_CYCLES]
    assert not new, f"import cycles through function-level imports: {new}; break them or add them with the reason"


def test_module_top_imports_have_no_cycle():
    graph = {m: {t for t, _, at_top in found if at_top} for m, found in _imports().items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            raise AssertionError("import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):]))
