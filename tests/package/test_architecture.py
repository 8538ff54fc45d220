"""The shape docs/ARCHITECTURE.md describes, enforced: layers that import downward only, no
cycles, no private names across packages, internal imports at the top of files (except where
start-up speed needs them inside functions), collectives only where the page says, an engine
that names no method's statistic, short functions, and benchmarks that use the package's
public names without editing sys.path."""
from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "iga_ds"

# bottom to top; a module may import its own package and packages of lower layers only
LAYERS = (
    ("errors",),
    ("files", "progress"),
    ("metrics", "methods", "models"),
    ("data", "lora"),
    ("config",),
    ("engine",),
    ("cluster",),  # above engine: `iga-ds selfcheck` probes DeepSpeed's ops through engine.internals
    ("train", "evaluation"),
    ("experiments", "integrations"),  # integrations: iga-ds inside other trainers (the HF Trainer)
    ("cli",),
    ("__main__",),
)
RANK = {pkg: rank for rank, group in enumerate(LAYERS) for pkg in group}
ROOT = "iga_ds"  # the facade: __version__, and public names imported on first use
MAX_FUNCTION_LINES = 60
# Besides third-party libraries, the standard-library modules as slow to import as one
# (importlib.metadata brings email, zipfile and csv along: some 25 ms). A command line's
# start-up loads none of them.
SLOW_STANDARD_MODULES = ("importlib.metadata",)
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


def is_heavy(module: str) -> bool:
    """Whether a command line's start-up must not load ``module``: a third-party library, or a
    slow part of the standard library."""
    root = module.split(".")[0]
    if root == ROOT:
        return False
    if root not in sys.stdlib_module_names:
        return True
    return any(module == slow or module.startswith(slow + ".") for slow in SLOW_STANDARD_MODULES)


def _import_time_statements(body: list[ast.stmt]):
    """The import statements that run when a module is imported: not those in functions, nor
    those under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_time_statements(node.orelse)
        else:  # class bodies, try/except, with, if, loops: all run on import
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _import_time_statements(getattr(node, field, None) or [])


@functools.cache
def _import_time_imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(iga_ds modules, other modules) that importing ``module`` imports itself. A ``from X
    import y`` counts as X and X.y: y may be a submodule (``from importlib import metadata``)."""
    internal, external = set(), set()
    for node in _import_time_statements(ast.parse(MODULES[module].read_text(encoding="utf-8")).body):
        if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == ROOT:
            internal |= {_resolve(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            external |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        else:
            for alias in node.names:
                (internal if alias.name.split(".")[0] == ROOT else external).add(alias.name)
    return frozenset(internal), frozenset(external)


def _with_packages(module: str) -> list[str]:
    """``module`` and the packages above it, which Python imports first."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1)]


@functools.cache
def heavy_imports_of(module: str) -> frozenset[str]:
    """The heavy modules (:func:`is_heavy`) that ``import module`` loads, through every iga_ds
    module it imports at import time."""
    seen: set[str] = set()
    todo = _with_packages(module)
    heavy = set()
    while todo:
        current = todo.pop()
        if current in seen or current not in MODULES:
            continue
        seen.add(current)
        internal, external = _import_time_imports(current)
        heavy |= {name for name in external if is_heavy(name)}
        todo += [m for target in internal for m in _with_packages(target)]
    return frozenset(heavy)


def test_internal_imports_sit_at_the_top_unless_start_up_needs_them():
    """An iga_ds import inside a function only in a command-line module or the facade, whose
    docstring says why (start-up), and only of a module that loads a heavy library when
    imported (:func:`is_heavy`, directly or through the modules it imports); any other import
    belongs at the top of the file, where the dependency graph can be read."""
    wrong = []
    for module, edges in GRAPH.items():
        for edge in (e for e in edges if e["in_function"]):
            where = f"{MODULES[module].relative_to(REPO)}:{edge['line']}: {edge['target']}"
            if module != ROOT and not module.endswith(".cli"):
                wrong.append(f"{where} (only command-line modules and the facade import inside functions)")
            elif "start-up" not in _docstring(module).replace("startup", "start-up"):
                wrong.append(f"{where} (the module's docstring does not say why: start-up)")
            elif not heavy_imports_of(edge["target"]):
                wrong.append(f"{where} (loads no heavy library when imported)")
    assert not wrong, "imports inside functions (move them to the top of the file):\n" + "\n".join(wrong)


def test_the_start_up_rule_sees_heavy_libraries_behind_other_modules():
    assert heavy_imports_of("iga_ds.errors") == frozenset()
    assert "torch" in heavy_imports_of("iga_ds.methods")  # through methods/base.py
    assert "importlib.metadata" in heavy_imports_of("iga_ds.cluster.selfcheck")  # from importlib import metadata
    assert "httpx" in heavy_imports_of("iga_ds.data.teacher.pipeline")  # through teacher/clients.py


def test_command_line_start_up_loads_no_heavy_library():
    """``iga-ds --help``: building every command's parser loads no torch, nor any other heavy
    library (what the interpreter loaded before iga_ds does not count)."""
    import subprocess

    code = ("import sys; before = set(sys.modules); import iga_ds.cli as c; c.build_parser(); "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    loaded = out.stdout.split()
    assert not [m for m in loaded if m.split(".")[0] == "torch"]
    assert not [m for m in loaded if is_heavy(m)], [m for m in loaded if is_heavy(m)]


# The modules that call collectives themselves, each with why: the hook's go through
# engine.collectives, and no other module calls any. docs/ARCHITECTURE.md lists the same.
COLLECTIVE_CALLERS = {
    "iga_ds.engine.collectives": "the hook's gradient collectives: reduce-scatter, all-gather, all-reduces",
    "iga_ds.engine.internals": "the gradient norm it computes for DeepSpeed, all-reduced over ZeRO's group "
                               "as DeepSpeed's own norm is",
    "iga_ds.train.trainer": "a step's losses and token counts summed over ranks; barriers after work one rank does",
    "iga_ds.train.checkpoint": "barriers around a checkpoint's save; all ranks agree on a stop request",
    "iga_ds.cluster.selfcheck": "the all-reduce and all-gather that `iga-ds selfcheck` checks",
    "iga_ds.cluster.ranks": "MPI broadcasts of the rendezvous address and port, before any process group exists",
    "iga_ds.cluster.liveness": "its heartbeat store's port broadcast from rank 0; a barrier once every rank's "
                               "first heartbeat is in",
}
# The modules that use a process group's library without a collective, each with why.
OTHER_PROCESS_GROUP_USERS = {
    "iga_ds.train.distributed": "meets the ranks at its store, starts the process group on it for DeepSpeed, reads "
                                "the ranks of one already up",
}
PROCESS_GROUP_LIBRARIES = ("torch.distributed", "deepspeed.comm", "mpi4py.MPI")
COLLECTIVE_OPERATIONS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "inference_all_reduce",
    "allreduce", "allgather", "alltoall", "bcast",  # mpi4py's spellings (compared in lower case)
})


def _dotted_names(tree: ast.AST) -> dict[ast.AST, str]:
    """Each name and attribute chain of a module that leads to an imported module, as the
    module's full name (``tdist.barrier`` -> ``torch.distributed.barrier``), through import
    aliases and plain assignments (``comm = MPI.COMM_WORLD``). Names are resolved per module,
    not per scope: enough to find these libraries, whose aliases are only ever bound to them."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound = a.asname or a.name.split(".")[0]  # `import torch.distributed` binds `torch`
                aliases[bound] = a.name if a.asname else bound
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})

    def resolve(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = resolve(node.value)
            if target:
                aliases[node.targets[0].id] = target
    return {node: name for node in ast.walk(tree) if (name := resolve(node))}


def process_group_use(source: str) -> tuple[bool, list[str]]:
    """(whether a module's source uses a process-group library, the collectives it calls as
    'line: name')."""
    names = _dotted_names(ast.parse(source))

    def of_library(name: str) -> bool:
        return any(name == lib or name.startswith(lib + ".") for lib in PROCESS_GROUP_LIBRARIES)

    calls = []
    for node, name in names.items():
        parent, _, operation = name.rpartition(".")
        if of_library(parent) and operation.lower() in COLLECTIVE_OPERATIONS:
            calls.append(f"{node.lineno}: {name}")
    return any(of_library(name) for name in names.values()), sorted(set(calls))


PROCESS_GROUP_USE = {m: process_group_use(path.read_text(encoding="utf-8")) for m, path in MODULES.items()}


def test_collectives_are_called_only_where_the_architecture_says():
    """The hook's collectives go through engine.collectives; a few modules call their own, for
    reasons that are not the hook's (COLLECTIVE_CALLERS, and docs/ARCHITECTURE.md)."""
    callers = {m: calls for m, (_, calls) in PROCESS_GROUP_USE.items() if calls}
    unlisted = [f"{MODULES[m].relative_to(REPO)}:{call}" for m, calls in callers.items()
                if m not in COLLECTIVE_CALLERS for call in calls]
    assert not unlisted, ("collectives outside the modules allowed to call them (use engine.collectives, "
                          "or list the module with why here and in docs/ARCHITECTURE.md):\n" + "\n".join(unlisted))
    assert set(COLLECTIVE_CALLERS) <= set(callers), f"listed but calling none: {set(COLLECTIVE_CALLERS) - set(callers)}"


def test_process_group_libraries_are_used_only_where_the_architecture_says():
    """Process groups are set up, and talked to, only in the modules listed above."""
    users = {m for m, (uses, _) in PROCESS_GROUP_USE.items() if uses}
    allowed = set(COLLECTIVE_CALLERS) | set(OTHER_PROCESS_GROUP_USERS)
    assert users <= allowed, f"modules using {', '.join(PROCESS_GROUP_LIBRARIES)} unlisted: {sorted(users - allowed)}"
    assert set(OTHER_PROCESS_GROUP_USERS) <= users, f"listed but not using them: {set(OTHER_PROCESS_GROUP_USERS) - users}"


def test_the_collectives_check_reads_aliases_and_assignments():
    source = ("import torch\nimport torch.distributed as tdist\nfrom deepspeed import comm as dist\n"
              "from mpi4py import MPI\nfrom torch.distributed import all_to_all\ncomm = MPI.COMM_WORLD\n"
              "td = torch.distributed\ntdist.barrier(); dist.all_reduce(x); comm.Bcast(y); td.all_gather(z)\n"
              "all_to_all(v); torch.distributed.is_initialized(); rank.all_reduce(w)\n")
    uses, calls = process_group_use(source)
    assert uses and calls == ["8: deepspeed.comm.all_reduce", "8: mpi4py.MPI.COMM_WORLD.Bcast",
                              "8: torch.distributed.all_gather", "8: torch.distributed.barrier",
                              "9: torch.distributed.all_to_all"]
    assert process_group_use("import torch\ntorch.cuda.synchronize()\n") == (False, [])


def declared_statistics() -> set[str]:
    """The name of every ``Statistic(...)`` in methods/: what the methods' ``statistics`` hold
    (read from the source, so that this file needs no torch)."""
    names, wrong = set(), []
    for path in sorted((PACKAGE / "methods").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Statistic":
                name = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    names.add(name.value)
                else:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not wrong, "statistics whose name is not written out (this check cannot read them): " + ", ".join(wrong)
    return names


def test_the_engine_names_no_statistic():
    """The hook carries and combines statistics by each method's declaration
    (``GradientMethod.statistics``): no declared name appears in a string of engine/. A name
    with a placeholder (``weight_<n>``) is looked for with any number in its place."""
    names = declared_statistics()
    assert {"gir", "conflicting_pairs", "weight_<n>"} <= names, names  # the reading finds the declarations
    patterns = {name: re.compile(r"(?<!\w)" + r"\d*".join(map(re.escape, re.split(r"<\w+>", name))) + r"(?!\w)")
                for name in names}
    wrong = []
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                wrong += [f"{path.relative_to(REPO)}:{node.lineno}: {name}" for name, pattern in patterns.items()
                          if pattern.search(node.value)]
    assert not wrong, "statistic names in the engine (let the method's declaration carry them):\n" + "\n".join(wrong)


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


# the contract a new method implements, read in one sitting (docs/ARCHITECTURE.md, "Where to
# add"); what serves speed lives with the batched path (methods/iga/tiles.py) and the engine
MAX_METHOD_CONTRACT_LINES = 120


def test_the_method_contract_stays_short():
    lines = len((PACKAGE / "methods" / "base.py").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_METHOD_CONTRACT_LINES, (
        f"methods/base.py is {lines} lines (at most {MAX_METHOD_CONTRACT_LINES}): keep the contract there, "
        "move what serves speed to the batched path (methods/iga/) or the engine")


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


# what a user of the hook needs, and what only the experiment workbench uses (docs/ARCHITECTURE.md)
CORE = ("errors", "files", "progress", "metrics", "methods", "models", "data", "lora", "config", "engine",
        "cluster", "train")
WORKBENCH = ("iga_ds.data.teacher", "iga_ds.data.benchmarks", "iga_ds.evaluation", "iga_ds.experiments",
             "iga_ds.integrations")


def _in_workbench(module: str) -> bool:
    return any(module == w or module.startswith(w + ".") for w in WORKBENCH)


def _core_reach() -> dict[str, list[str]]:
    """Each workbench module a core module reaches through its imports (at the top or inside a
    function, one after another), with the chain that reaches it."""
    graph = {m: sorted({e["target"] for e in edges if e["target"] in MODULES}) for m, edges in GRAPH.items()}
    core = [m for m in MODULES if package_of(m) in CORE and not _in_workbench(m) and not m.endswith(".cli")]
    reached: dict[str, list[str]] = {}
    for start in core:
        chains, seen = [[start]], {start}
        while chains:
            chain = chains.pop()
            for nxt in graph[chain[-1]]:
                if nxt in seen:
                    continue
                seen.add(nxt)
                if _in_workbench(nxt):
                    reached.setdefault(nxt, chain + [nxt])
                else:
                    chains.append(chain + [nxt])
    return reached


def test_the_core_imports_nothing_from_the_workbench():
    """The hook's user (methods, LoRA capture, engine, config, trainer) needs no teacher pipeline,
    benchmark loader, evaluation, grid, report or integration; the commands (``cli.py``) may."""
    reached = _core_reach()
    assert not reached, "core modules that reach the workbench:\n" + "\n".join(
        " -> ".join(chain) for chain in reached.values())


def test_the_core_reach_check_follows_chains(monkeypatch):
    monkeypatch.setitem(GRAPH, "iga_ds.files", [*GRAPH["iga_ds.files"], {"target": "iga_ds.experiments.report"}])
    assert _core_reach()["iga_ds.experiments.report"][-2:] == ["iga_ds.files", "iga_ds.experiments.report"]
