"""Run names are single path components: ``run_name=../../x`` must not write outside the outputs
directory, nor ``run_name=a/b/c`` nest runs.

Hydra creates ``hydra.run.dir`` (and writes ``.hydra/`` there) before a command's own code runs,
so the check sits where the name enters that path: the configs spell it
``${path_component:${run_name}}``, a resolver registered by ``specdraft.conf`` (which Hydra imports
to read the configs). An unsafe name ends the command there, before anything is created, with the
one-line error of system/errors.py and its exit code.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from specdraft.system.errors import USER_ERROR_EXIT_CODE, one_line

RESOLVER = "path_component"
# Not in a name: path separators; not a name: these (the directory itself, its parent).
SEPARATORS = ("/", "\\", "\0")
NOT_NAMES = ("", ".", "..")


def check_path_component(name: object, key: str = "run_name") -> str:
    """``name`` as a string if it is one safe directory name (no separator, not empty, not hidden:
    ``.``, ``..`` and ``.x`` are refused too), else ``ValueError`` naming ``key``."""
    text = str(name)
    if text in NOT_NAMES or text.startswith(".") or any(s in text for s in SEPARATORS):
        raise ValueError(
            f"{key}={text!r}: expected one directory name (no '/', '\\', a leading '.', nor empty), "
            "as it names a directory inside the outputs"
        )
    return text


def _resolve(name: object, key: str = "run_name") -> str:
    """The resolver: Hydra reports a resolver's exception with a traceback, so the refusal is the
    command's one-line error here (the command named as it was invoked)."""
    try:
        return check_path_component(name, key)
    except ValueError as error:
        print(f"{Path(sys.argv[0]).name}: error: {one_line(str(error))}", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT_CODE) from None


def register_resolver() -> None:
    """Make ``${path_component:…}`` available to the configs (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _resolve)
