"""What every command says when its input is wrong: one line, exit code 2.

Each entry point runs under :func:`user_errors`. A user error — a bad value or setting
(``ValueError`` and its kinds: a head file that is not one, a cache or run directory that refuses
to resume, a config value Hydra cannot resolve), a missing file — ends the command with
``<command>: error: <message>`` on stderr, on ONE line, and exit code 2; ``SPECDRAFT_DEBUG=1``
shows the traceback instead. A ``SystemExit`` with a message (a check inside the command) reads the
same. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from omegaconf.errors import OmegaConfBaseException

USER_ERROR_EXIT_CODE = 2  # as argparse uses for a bad command line
DEBUG_ENV = "SPECDRAFT_DEBUG"
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, OmegaConfBaseException)

Entry = TypeVar("Entry", bound=Callable[..., Any])


def one_line(message: str) -> str:
    """A message on one line: its lines joined with "; " (a list of differing keys stays readable)."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


def user_errors(command: str) -> Callable[[Entry], Entry]:
    """Decorate ``command``'s entry point (under ``@hydra.main``, or an argparse ``main``)."""

    def decorate(entry: Entry) -> Entry:
        @functools.wraps(entry)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return entry(*args, **kwargs)
            except SystemExit as stop:
                if not isinstance(stop.code, str):  # argparse and Hydra exit with codes: theirs stand
                    raise
                message = stop.code.removeprefix(f"{command}: ")
            except USER_ERRORS as error:
                if os.environ.get(DEBUG_ENV):
                    raise
                message = str(error) if str(error) else type(error).__name__
            print(f"{command}: error: {one_line(message)}", file=sys.stderr)
            raise SystemExit(USER_ERROR_EXIT_CODE)

        return run  # type: ignore[return-value]

    return decorate
