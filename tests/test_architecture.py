"""The shape docs/ARCHITECTURE.md describes, enforced: layers that import downward only, no
cycles, no private names across packages, internal imports at the top of files (except where
start-up speed needs them inside functions), short functions, and benchmarks that use the
package's public names without editing sys.path."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "iga_ds"

# bottom to top; a module may import its own package and packages of lower layers only
LAYERS = (
    ("errors",),
    ("files",),
    ("metrics", "methods", "models"),
    ("data", "lora"),
    ("config",),
    ("engine", "cluster"),
    ("train", "evaluation"),
    ("experiments",),
    ("cli",),
    ("__main__",),
)
RANK = {pkg: rank for rank, group in enumerate(LAYERS) for pkg in group}
ROOT = "iga_ds"  # the facade: __version__, and public names imported on first use
MAX_FUNCTION_LINES = 60
# functions allowed to be longer, each with why
LONG_FUNCTIONS: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def package_of(module: str) -> str:
    parts = module.split(".")
    return ROOT if len(parts) == 1 else parts[1]


def _resolve(name: str, imported: str | None) -> str:
    """The module an import statement reaches: a submodule when ``imported`` names one."""
    if imported and f"{name}.{imported}" in MODULES:
        return f"{name}.{imported}"
    return name


def _function_ranges(tree: ast.AST) -> list[tuple[int, int]]:
    return [(n.lineno, n.end_lineno) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def imports_of(module: str) -> list[dict]:
    """Every iga_ds import in a module: target module, names taken, whether inside a function."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    functions = _function_ranges(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; write the absolute name")
        inside = any(a <= node.lineno <= b for a, b in functions) if isinstance(node, (ast.Import, ast.ImportFrom)) \
            else False
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == ROOT:
            found += [{"target": _resolve(node.module, a.name), "name": a.name, "line": node.lineno,
                       "in_function": inside} for a in node.names]
        elif isinstance(node, ast.Import):
            found += [{"target": a.name, "name": None, "line": node.lineno, "in_function": inside}
                      for a in node.names if a.name.split(".")[0] == ROOT]
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in MODULES} - {ROOT}
    assert packages <= set(RANK), f"packages without a layer in this test and docs/ARCHITECTURE.md: {packages - set(RANK)}"
    assert set(RANK) - {"__main__"} <= packages | {"__main__"}


def test_imports_go_down_the_layers():
    wrong = []
    for module, edges in GRAPH.items():
        src = package_of(module)
        for edge in edges:
            dst = package_of(edge["target"])
            if src == dst:
                continue
            if src == ROOT:  # the facade may name anything, on first use only (checked below)
                continue
            if dst == ROOT and edge["name"] == "__version__":
                continue
            if dst == ROOT or RANK[dst] >= RANK[src]:
                wrong.append(f"{MODULES[module].relative_to(REPO)}:{edge['line']}: {src} imports {dst} "
                             f"({edge['target']})")
    assert not wrong, "imports that go up or across the layers:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: sorted({e["target"] for e in edges if e["target"] in MODULES and e["target"] != m})
             for m, edges in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_names_across_packages():
    wrong = [f"{MODULES[m].relative_to(REPO)}:{e['line']}: {e['name']} from {e['target']}"
             for m, edges in GRAPH.items() for e in edges
             if e["name"] and e["name"].startswith("_") and e["name"] != "__version__"
             and package_of(e["target"]) != package_of(m)]
    assert not wrong, "private names imported from another package:\n" + "\n".join(wrong)


def _docstring(module: str) -> str:
    return ast.get_docstring(ast.parse(MODULES[module].read_text(encoding="utf-8"))) or ""


def test_internal_imports_sit_at_the_top_unless_start_up_needs_them():
    """Function-level imports of iga_ds only in command-line modules and the facade, each of
    which says why in its docstring (start-up: ``iga-ds --help`` loads no torch)."""
    wrong = []
    for module, edges in GRAPH.items():
        inner = [e for e in edges if e["in_function"]]
        if not inner:
            continue
        allowed = module == ROOT or module.endswith(".cli")
        if not allowed or "start-up" not in _docstring(module).replace("startup", "start-up"):
            wrong += [f"{MODULES[module].relative_to(REPO)}:{e['line']}: {e['target']}" for e in inner]
    assert not wrong, "imports inside functions (move them to the top of the file):\n" + "\n".join(wrong)


def test_command_line_start_up_loads_no_torch():
    import subprocess
    import sys

    code = ("import sys; import iga_ds.cli as c; c.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_functions_are_short():
    wrong = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                key = f"{module}.{node.name}"
                if length > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.name} is {length} lines")
    assert not wrong, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", sorted((REPO / "bench").glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_use_public_names_only(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    source = path.read_text(encoding="utf-8")
    assert "sys.path" not in source, f"{path.name}: edits sys.path"
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT):
            for alias in node.names:
                assert not alias.name.startswith("_"), f"{path.name}:{node.lineno}: private {alias.name}"
                if f"{node.module}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(ROOT):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            assert not node.attr.startswith("_"), f"{path.name}:{node.lineno}: private {node.value.id}.{node.attr}"


def test_architecture_doc_lists_the_layers_this_test_enforces():
    import re

    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    documented = {pkg: int(rank) for rank, pkg in re.findall(r"^\| (\d+) \| `(\w+)` \|", text, flags=re.M)}
    assert documented == {pkg: rank for pkg, rank in RANK.items() if pkg != "__main__"}
