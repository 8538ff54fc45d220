"""pyproject.toml declares what iga_ds imports, and imports what it declares.

Every top-level module imported anywhere under iga_ds/ (at module level or inside a function, and
the optional ones probed with ``importlib.util.find_spec``) that is not the standard library's
must be a distribution named in ``[project] dependencies`` or in an extra; every dependency
and extra meant for users (not the test extra) must be imported, or be in USED_WITHOUT_IMPORT
with the reason.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# import name -> distribution name, where the two differ by more than '-' and '_'
DISTRIBUTION_OF = {"yaml": "pyyaml", "mlflow": "mlflow-skinny"}
USED_WITHOUT_IMPORT = {
    "tensorboard": "torch.utils.tensorboard writes the events through it (iga_ds.train.logbook)",
}
TEST_ONLY_EXTRAS = {"test"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _canonical(re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def imported_modules() -> dict[str, str]:
    """Third-party top-level module -> the first file under iga_ds/ that imports it."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "iga_ds").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for name in _modules_named(node):
                top = name.split(".")[0]
                if top != "iga_ds" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def _modules_named(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.level == 0 and node.module else []
    probes = [call for call in ast.walk(node) if isinstance(call, ast.Call)
              and isinstance(call.func, ast.Attribute) and call.func.attr in ("find_spec", "import_module")]
    if isinstance(node, ast.Call) and node in probes and isinstance(node.args[0], ast.Constant):
        return [node.args[0].value]  # find_spec("mpi4py")
    if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)) and probes:
        names = node.generators[0].iter  # [n for n in ("gguf", "accelerate") if find_spec(n) is None]
        if isinstance(names, ast.Tuple) and all(isinstance(e, ast.Constant) for e in names.elts):
            return [e.value for e in names.elts]
    return []


def declared() -> tuple[set[str], dict[str, set[str]]]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    runtime = {_requirement_name(r) for r in project["dependencies"]}
    extras = {extra: {_requirement_name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()}
    return runtime, extras


def test_every_import_is_declared():
    runtime, extras = declared()
    everything = runtime.union(*extras.values())
    missing = {module: where for module, where in imported_modules().items()
               if _canonical(DISTRIBUTION_OF.get(module, module)) not in everything}
    assert not missing, f"imported but not in pyproject.toml's dependencies or extras: {missing}"


def test_every_runtime_dependency_is_used():
    runtime, extras = declared()
    for_users = runtime.union(*(names for extra, names in extras.items() if extra not in TEST_ONLY_EXTRAS))
    imported = {_canonical(DISTRIBUTION_OF.get(module, module)) for module in imported_modules()}
    unused = for_users - imported - {_canonical(name) for name in USED_WITHOUT_IMPORT}
    assert not unused, f"declared but never imported under iga_ds/: {sorted(unused)}"


def test_every_documented_extra_exists():
    """``pip install 'iga-ds[NAME]'`` where users read it (docs, README, error messages, config
    references): each NAME is an extra of pyproject.toml (pip only warns about an unknown one)."""
    _, extras = declared()
    texts = [*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md"), *(REPO / "iga_ds").rglob("*.py"),
             *(REPO / "bench").glob("*.py")]
    named = {(str(path.relative_to(REPO)), name) for path in texts
             for group in re.findall(r"iga-ds\[([a-z0-9_,-]+)\]", path.read_text(encoding="utf-8"))
             for name in group.split(",")}
    assert any(name == "liger" for _, name in named)  # the pattern finds what it is for
    unknown = sorted((where, name) for where, name in named if name not in extras)
    assert not unknown, f"pip extras named but not declared in pyproject.toml: {unknown}"
