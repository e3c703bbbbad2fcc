"""The structure of meshlm (docs/architecture.md), checked from its source: layers, no import cycles, no private
names across packages, small functions, family names compared only in families/.

The layers are read from the import-linter contract in pyproject.toml (one statement of them). `lint-imports`
checks them too (the README's test command runs it); these tests read every import statement with `ast`,
those inside functions included, so they hold whatever import-linter does, and one of them shows that
`lint-imports` itself sees an import inside a function.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "meshlm"
MAX_FUNCTION_LINES = 80


def contract(contract_id: str) -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return next(c for c in config["contracts"] if c["id"] == contract_id)


def layers() -> list[list[str]]:
    """Top to bottom; each layer a list of sibling packages (short names: 'cli', 'plan', ...)."""
    return [[name.strip().removeprefix("meshlm.") for name in layer.split("|")] for layer in contract("layers")["layers"]]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, module: str) -> list[tuple[int, str, str]]:
    """(line, imported meshlm module, imported name or '') for every import statement of the file, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [(node.lineno, base, a.name) for a in node.names]
    return [(line, target, name) for line, target, name in found if target.split(".")[0] == "meshlm"]


def edges() -> dict[str, dict[str, str]]:
    """module → {imported module → 'file:line'} (a `from package import submodule` counts as the submodule)."""
    mods = modules()
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for module, path in mods.items():
        for line, target, name in imports(path, module):
            full = f"{target}.{name}" if f"{target}.{name}" in mods else target
            while full not in mods:
                full = full.rpartition(".")[0]
            if full != module:
                out[module].setdefault(full, f"{path.relative_to(ROOT)}:{line}")
    return out


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
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
                comps.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return comps


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle_between_meshlm_modules():
    graph = edges()
    found = cycles(graph)
    report = [" -> ".join(comp) + "\n  " + "\n  ".join(f"{graph[a][b]}: {a} -> {b}" for a in comp for b in graph[a]
                                                         if b in comp) for comp in found]
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(report)


def test_the_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == [["a", "b", "c"]]


def test_every_import_runs_down_the_layers():
    rank = {name: i for i, layer in enumerate(layers()) for name in layer}
    sibling = {name: set(layer) for layer in layers() for name in layer}
    listed = {package_of(m) for m in modules()} - {""}
    assert listed - {"__main__"} <= set(rank), f"packages missing from the layers contract: {listed - set(rank)}"
    bad = []
    for module, targets in edges().items():
        src = package_of(module)
        for target, where in targets.items():
            dst = package_of(target)
            if src in ("", "__main__") or dst == src:
                continue
            if dst == "" or rank[dst] < rank[src] or (rank[dst] == rank[src] and dst in sibling[src]):
                bad.append(f"{where}: {module} -> {target}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_every_package_says_what_it_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import:" in doc, f"{init.relative_to(ROOT)}: its docstring names no 'May import:' line"


def test_model_files_import_only_core_and_models():
    files = {"gpt": PACKAGE / "models" / "gpt.py", "bert": PACKAGE / "models" / "bert.py",
             "toy (a family added by the tests)": ROOT / "tests" / "families" / "toy_model.py"}
    for name, path in files.items():
        targets = {package_of(t) for _, t, _ in imports(path, "meshlm.models.x")}
        assert targets <= {"core", "models"}, (name, targets)


def test_no_private_name_is_imported_across_packages():
    bad = []
    for module, path in modules().items():
        for line, target, name in imports(path, module):
            if name.startswith("_") and package_of(target) != package_of(module):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {target}.{name}")
    assert not bad, "private names used across packages:\n" + "\n".join(bad)


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def family_comparisons(path: Path) -> list[int]:
    """Lines comparing something named `family` with a string constant (`cfg.family == "gpt"`, `family in (...)`)."""
    def named_family(node):
        return (isinstance(node, ast.Attribute) and node.attr == "family") or (isinstance(node, ast.Name)
                                                                                and node.id == "family")

    def strings(node):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(strings(e) for e in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(named_family(s) for s in sides) and any(strings(s) for s in sides):
                found.append(node.lineno)
    return found


def test_only_families_compare_family_names():
    bad = [f"{path.relative_to(ROOT)}:{line}" for module, path in modules().items() if package_of(module) != "families"
           for line in family_comparisons(path)]
    assert not bad, "family names compared outside families/ (make it a ModelSpec field):\n" + "\n".join(bad)


def test_the_family_check_finds_a_planted_comparison(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text("def f(cfg):\n    return cfg.model.family == 'bert' or family in ('gpt',)\n")
    assert family_comparisons(planted) == [2, 2]


def lint_imports() -> str:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports (import-linter) is not installed: scripts/setup.sh --test installs it")
    return exe


def test_lint_imports_passes_and_sees_an_import_inside_a_function(tmp_path):
    ok = subprocess.run([lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                        check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The same contract on a copy of the package with one lazy import planted against the layers.
    shutil.copytree(PACKAGE, tmp_path / "meshlm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    errors = tmp_path / "meshlm" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _late():\n    from meshlm.cli import main\n\n    return main\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    planted = subprocess.run([lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300, env=env, check=False)
    assert planted.returncode != 0, planted.stdout
    assert "meshlm.core.errors -> meshlm.cli" in planted.stdout, planted.stdout
