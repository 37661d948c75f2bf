"""The house rules a newcomer can rely on: no module over 500 lines, no public constructor
written with more than 15 parameters (a settings object holds the rest), no class built of
several of the package's own classes (a class owns parts it is given or makes, and calls them by
name, rather than inheriting their methods and sharing their attributes through ``self``), and
every module hook the package installs registered in one place (``core/hook_recorder.py``).

The settings dataclasses (``KernelOptions``, ``MatrixFreeOptions``, ``PenaltyOptions``, ...) are
the objects that carry options, so their generated constructors are not counted: each field is
one option of one structure, set by name.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_flatness"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 500
MAX_CONSTRUCTOR_PARAMETERS = 15


def _classes(path: Path) -> list[ast.ClassDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_over_500_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_name(path)} has {lines} lines"


@functools.cache
def _package_class_names() -> frozenset[str]:
    """Every class name of the package (parsed once for all the parametrized cases)."""
    return frozenset(node.name for path in MODULES for node in _classes(path))


def _package_bases(node: ast.ClassDef, package: set[str]) -> set[str]:
    names = {
        base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases
    }
    return names & package


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_class_inherits_from_several_package_classes(path):
    package = _package_class_names()
    for node in _classes(path):
        bases = _package_bases(node, package)
        assert len(bases) <= 1, (
            f"{_name(path)}: class {node.name} inherits from {sorted(bases)} of the package; "
            "make them parts it owns and calls by name"
        )


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_public_constructor_over_15_parameters(path):
    for node in _classes(path):
        if node.name.startswith("_"):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                arguments = item.args
                count = len(arguments.posonlyargs) + len(arguments.args) - 1
                count += len(arguments.kwonlyargs)
                assert count <= MAX_CONSTRUCTOR_PARAMETERS, (
                    f"{_name(path)}: {node.name}.__init__ takes {count} parameters; gather "
                    "options into a settings object"
                )


#: the registrations of module hooks: only the hook recorder makes them
HOOK_REGISTRATIONS = (
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_module_forward_hook",
)
HOOK_RECORDER = PACKAGE / "core" / "hook_recorder.py"


def _hook_registrations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{_name(path)}:{node.lineno} {node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in HOOK_REGISTRATIONS
    ]


def test_module_hooks_are_registered_by_the_hook_recorder_only():
    others = [path for path in MODULES if path != HOOK_RECORDER]
    outside = [hit for path in others for hit in _hook_registrations(path)]
    assert not outside, f"module hooks registered outside the HookRecorder: {outside}"
    assert _hook_registrations(HOOK_RECORDER)  # the check reads what it claims to


def test_the_rules_can_fail(tmp_path):
    """The checks above read what they claim to: a long module, a wide constructor and a class
    of two package classes."""
    wide = tmp_path / "wide.py"
    parameters = ", ".join(f"a{i}" for i in range(16))
    wide.write_text(f"class Wide:\n    def __init__(self, {parameters}):\n        pass\n")
    (node,) = _classes(wide)
    init = node.body[0]
    assert len(init.args.args) - 1 == 16 > MAX_CONSTRUCTOR_PARAMETERS
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert len(long.read_text().splitlines()) > MAX_MODULE_LINES
    mixed = tmp_path / "mixed.py"
    mixed.write_text("class A:\n    pass\nclass B:\n    pass\nclass C(A, B, object):\n    pass\n")
    *_, node = _classes(mixed)
    assert _package_bases(node, {"A", "B", "C"}) == {"A", "B"}


def test_every_lightning_hook_of_the_monitor_is_in_its_own_file():
    """A reader finds each of the monitor's Lightning hooks in ``lightning/monitor.py``; its
    parts' modules define none (``on_*``, ``setup``, ``teardown``)."""
    parts = sorted((PACKAGE / "lightning").glob("monitor_*.py"))
    assert parts  # the check reads what it claims to
    hooks = [
        f"{_name(path)}: {node.name}.{item.name}"
        for path in parts
        for node in _classes(path)
        for item in node.body
        if isinstance(item, ast.FunctionDef)
        and (item.name.startswith("on_") or item.name in ("setup", "teardown"))
    ]
    assert not hooks, f"Lightning hooks outside lightning/monitor.py: {hooks}"
