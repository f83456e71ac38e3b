"""The import rules of docs/architecture.md §1: which specdraft package may import which, read from
every module's ``import`` statements (those inside functions too), and what ``heads`` loads.

The table below is the one place the rules live as data; the doc states the same table."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package → the other specdraft packages it may import. Nothing outside tests/ and scripts/
# imports `recipes`: it is the only package that joins `train` and `eval`.
MAY_IMPORT: dict[str, set[str]] = {
    "system": set(),
    "heads": {"system"},
    "data": {"system", "heads"},
    "train": {"system", "heads", "data"},
    "eval": {"system", "heads", "data"},
    "recipes": {"system", "heads", "data", "train", "eval"},
}
# Beyond the standard library, what heads, and every specdraft module it imports, may import:
# an export can be read (and a head built) without the training or serving stack.
HEADS_MAY_IMPORT = {"torch", "safetensors"}
# What a heads import must not load, whatever imports it (checked in a fresh interpreter).
HEAVY = ("transformers", "lightning", "pytorch_lightning", "hydra", "wandb", "datasets", "omegaconf")


def module_name(path: Path) -> str:
    """``heads/formats/files.py`` → ``specdraft.heads.formats.files`` (``__init__``: the package)."""
    parts = ["specdraft", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(name: str) -> set[str]:
    """Every absolute module the module ``name`` imports: ``from a.b import c`` counts as ``a.b``
    and, should c be a module, ``a.b.c``; relative imports are resolved against its package."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]).rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = {
    module_name(path): path for package in MAY_IMPORT for path in sorted((ROOT / package).rglob("*.py"))
}


def specdraft_imports(name: str) -> set[str]:
    """The specdraft modules ``name`` imports (names that are modules: ``from m import f`` is m)."""
    return {m for m in imported_modules(name) if m in MODULES}


def package_of(name: str) -> str:
    return name.split(".")[1]


def forbidden_imports(package: str) -> list[str]:
    """``module -> imported`` for every import of a specdraft package ``package`` may not import."""
    return sorted(
        f"{name} -> {imported}"
        for name in MODULES
        if package_of(name) == package
        for imported in specdraft_imports(name)
        if package_of(imported) not in MAY_IMPORT[package] | {package}
    )


def test_every_package_folder_is_in_the_table():
    """A new top-level package gets its row (and its row in docs/architecture.md §1)."""
    installed = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"conf", "tests"}
    assert installed == set(MAY_IMPORT)


@pytest.mark.parametrize("package", list(MAY_IMPORT))
def test_packages_import_only_what_the_table_allows(package):
    assert forbidden_imports(package) == []


def test_a_forbidden_import_is_caught(monkeypatch, tmp_path):
    """The check sees an import inside a function, of a module or of a name from it."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from specdraft.recipes.budget import clock\n")
    name = "specdraft.eval.bad_for_the_test"
    monkeypatch.setitem(MODULES, name, bad)
    assert forbidden_imports("eval") == [f"{name} -> specdraft.recipes.budget"]


def test_heads_and_what_it_imports_use_only_the_stdlib_torch_and_safetensors():
    reached, todo = set(), [name for name in MODULES if package_of(name) == "heads"]
    while todo:  # heads and every specdraft module it reaches, however indirectly
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(specdraft_imports(name))
    allowed = set(sys.stdlib_module_names) | HEADS_MAY_IMPORT | {"specdraft", "__future__"}
    outside = sorted(
        f"{name} -> {imported}"
        for name in reached
        for imported in imported_modules(name)
        if imported.split(".")[0] not in allowed
    )
    assert outside == []


def test_importing_heads_loads_none_of_the_heavy_stack():
    """What the interpreter actually loads: the static rules above, and torch's own imports."""
    code = (
        "import sys, specdraft.heads, specdraft.heads.registry, specdraft.heads.formats; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
