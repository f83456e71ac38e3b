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
WORKER_TRACEBACK = "Original Traceback (most recent call last):"  # torch's ExceptionWrapper
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, OmegaConfBaseException)

Entry = TypeVar("Entry", bound=Callable[..., Any])


def one_line(message: str) -> str:
    """A message on one line: its lines joined with "; " (a list of differing keys stays readable)."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


def error_message(error: BaseException) -> str:
    """What ``error`` says. One raised in a DataLoader worker reaches the main process re-raised
    by torch with the worker's traceback inside its message: only the original message is kept."""
    message = str(error) or type(error).__name__
    if WORKER_TRACEBACK in message:
        lines = message.splitlines()
        prefix = f"{type(error).__name__}: "
        starts = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        if starts:
            message = "\n".join(lines[starts[-1] :]).removeprefix(prefix)
    return message


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
                message = error_message(error)
            print(f"{command}: error: {one_line(message)}", file=sys.stderr)
            raise SystemExit(USER_ERROR_EXIT_CODE)

        return run  # type: ignore[return-value]

    return decorate
