"""The package's modules import each other without cycles (a deferred import inside a function
that closes a loop counts too: it only hides the cycle)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightning_flatness

PACKAGE = Path(lightning_flatness.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: the package's modules it imports anywhere in its source}``."""
    sources = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in sources and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def fresh_python(code: str) -> str:
    """What ``code`` prints, run in a new interpreter (nothing imported beforehand)."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_sweep_configuration_does_not_load_the_command_line():
    """Reading a sweep configuration needs two class paths, not LightningCLI and jsonargparse."""
    code = (
        "import sys, lightning_flatness.sweep.config; "
        "print(int('jsonargparse' in sys.modules or 'lightning.pytorch.cli' in sys.modules))"
    )
    loaded = fresh_python(code)
    assert loaded == "0"


def _imported_roots(path: Path) -> set[str]:
    """Top-level names of every absolute import anywhere in ``path`` (deferred ones too)."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module)
        elif isinstance(node, ast.Import):
            roots.update(alias.name for alias in node.names)
    return roots


def _pure_torch_modules() -> list[Path]:
    """The core (without its BackPACK part) and the regularizer."""
    core = [p for p in (PACKAGE / "core").rglob("*.py") if "backpack" not in p.parts]
    return core + sorted((PACKAGE / "regularizer").rglob("*.py"))


def _layer_violations(path: Path) -> list[str]:
    forbidden = ("lightning", "pytorch_lightning", "backpack")
    inner = ("lightning_flatness.lightning", "lightning_flatness.sweep")
    return sorted(
        name
        for name in _imported_roots(path)
        if name.split(".")[0] in forbidden or name.startswith(inner)
    )


def test_the_core_and_the_regularizer_name_neither_lightning_nor_backpack():
    """Statically: no module of the core (outside ``core/backpack``) or of the regularizer
    imports Lightning, BackPACK or the package's Lightning layer, not even inside a function."""
    offenders = {
        str(path.relative_to(PACKAGE)): found
        for path in _pure_torch_modules()
        if (found := _layer_violations(path))
    }
    assert offenders == {}


def test_the_layer_test_sees_a_forbidden_import(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("def f():\n    from lightning.pytorch import Trainer\n", encoding="utf-8")
    assert _layer_violations(module) == ["lightning.pytorch"]
    module.write_text("from lightning_flatness.lightning.monitor import FlatnessMonitor\n")
    assert _layer_violations(module) == ["lightning_flatness.lightning.monitor"]
    module.write_text("import torch\nfrom lightning_flatness.core import measure\n")
    assert _layer_violations(module) == []


def test_importing_the_core_loads_neither_lightning_nor_backpack():
    """At run time: the package, every pure-torch module and a kfac measurement load neither."""
    modules = sorted(_module_name(path) for path in _pure_torch_modules())
    code = (
        "import sys, importlib, torch\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "import lightning_flatness as lf\n"
        "nn = torch.nn\n"
        "model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))\n"
        "batches = [(torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1]))]\n"
        "lf.measure(model, batches, lam=0.1, num_train_samples=5)\n"
        "lf.measure(model, batches, lam=0.1, num_train_samples=5, structure='lanczos')\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "print(sorted(roots & {'lightning', 'pytorch_lightning', 'backpack'}))\n"
    )
    loaded = fresh_python(code)
    assert loaded == "[]"
