"""What every command says when its input is wrong: one line, exit code 2.

Each entry point runs under :func:`user_errors` (an argparse ``main``) or :func:`hydra_command`
(a Hydra one), which puts it on both sides of ``@hydra.main``: outside, with ``HYDRA_FULL_ERROR=1``
set for the call so that Hydra re-raises its own errors (config composition, an unknown key, bad
override syntax, a missing config group option) instead of printing them over several lines with
exit code 1; inside, around the task, so that an error in the job (``instantiate`` included)
leaves as a ``SystemExit`` which Hydra lets through without its "Error executing job" line.

A user error ends the command with ``<command>: error: <message>`` on stderr, on ONE line, and
exit code 2; ``SPECDRAFT_DEBUG=1`` shows the traceback instead. User errors are: a bad value or
setting (``ValueError`` and its kinds: a head file that is not one, a cache or run directory that
refuses to resume, a config value OmegaConf cannot resolve); Hydra's own errors; an
``InstantiationException`` whose cause is a user error (its cause's message, naming the
``_target_`` and key); and the user's environment — an ``OSError`` that names a file (missing,
unreadable, unwritable, on a read-only file system) or is a missing/permission error. A
``SystemExit`` with a message (a check inside the command) reads the same. Anything else — an
``InstantiationException`` caused by a bug, a bare ``OSError`` without a file — is a bug and keeps
its traceback. Readers of user files turn a decode error into a ``ValueError`` naming the file.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import hydra
from hydra.errors import HydraException, InstantiationException
from omegaconf.errors import OmegaConfBaseException

USER_ERROR_EXIT_CODE = 2  # as argparse uses for a bad command line
DEBUG_ENV = "SPECDRAFT_DEBUG"
CONFIG_PATH = "pkg://specdraft.conf"
HYDRA_VERSION_BASE = "1.3"
HYDRA_FULL_ERROR_ENV = "HYDRA_FULL_ERROR"  # Hydra's run_and_report re-raises under it
WORKER_TRACEBACK = "Original Traceback (most recent call last):"  # torch's ExceptionWrapper
USER_OS_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
USER_ERRORS = (ValueError, OSError, OmegaConfBaseException, HydraException)
# What the user is expected to provide, per errno of a file error.
EXPECTED = {
    errno.ENOENT: "expected an existing path",
    errno.EACCES: "expected a path this user may read and write",
    errno.EPERM: "expected a path this user may read and write (not immutable)",
    errno.EROFS: "expected a writable file system",
    errno.ENOSPC: "expected free disk space",
    errno.ENOTDIR: "expected a directory",
    errno.EISDIR: "expected a file, not a directory",
}
INSTANTIATE_TARGET = re.compile(r"target '([^']+)'")
INSTANTIATE_KEY = re.compile(r"full_key: (\S+)")

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


def os_error_message(error: OSError) -> str | None:
    """The file, what went wrong and what was expected; None for an OSError that names no file
    and is not a missing/permission error (a bug or a library's own failure: its traceback stays)."""
    if error.filename is None:
        if isinstance(error, USER_OS_ERRORS):
            return error_message(error)  # our own FileNotFoundError("head checkpoint … does not exist")
        return None
    where = str(error.filename) + (f" -> {error.filename2}" if error.filename2 is not None else "")
    reason = error.strerror or type(error).__name__
    expected = EXPECTED.get(error.errno) if error.errno is not None else None
    return f"{where}: {reason}" + (f" ({expected})" if expected else "")


def instantiation_message(error: InstantiationException) -> str | None:
    """The cause's message, naming the ``_target_`` and the config key; None when the cause is a
    bug. Without a cause (a target that cannot be located, bad ``_args_``) Hydra's own message."""
    cause = error.__cause__
    if cause is None or isinstance(cause, ImportError):
        return str(error)
    inner = user_message(cause)
    if inner is None:
        return None
    text = str(error)
    target, key = INSTANTIATE_TARGET.search(text), INSTANTIATE_KEY.search(text)
    where = ", ".join(part for part in (target and f"_target_ {target[1]}", key and f"key {key[1]}") if part)
    return f"{inner} (instantiating {where})" if where else inner


def user_message(error: BaseException) -> str | None:
    """What the one line says for ``error``; None when it is a bug (its traceback stays)."""
    if isinstance(error, InstantiationException):
        return instantiation_message(error)
    if isinstance(error, HydraException):
        cause = error.__cause__
        extra = f"\n{cause}" if isinstance(cause, OmegaConfBaseException) else ""
        return str(error).replace(", set env var HYDRA_FULL_ERROR=1 to see chained exception", "") + extra
    if isinstance(error, OSError):
        return os_error_message(error)
    if isinstance(error, ValueError | OmegaConfBaseException):
        return error_message(error)
    return None


def user_errors(command: str) -> Callable[[Entry], Entry]:
    """Decorate ``command``'s argparse ``main`` (a Hydra one: :func:`hydra_command`)."""

    def decorate(entry: Entry) -> Entry:
        @functools.wraps(entry)
        def run(*args: Any, **kwargs: Any) -> Any:
            before = os.environ.get(HYDRA_FULL_ERROR_ENV)
            os.environ[HYDRA_FULL_ERROR_ENV] = "1"
            try:
                return entry(*args, **kwargs)
            except SystemExit as stop:
                if not isinstance(stop.code, str):  # argparse and Hydra exit with codes: theirs stand
                    raise
                message = stop.code.removeprefix(f"{command}: ")
            except USER_ERRORS as error:
                found = user_message(error)
                if found is None or os.environ.get(DEBUG_ENV):
                    raise
                message = found
            finally:
                if before is None:
                    os.environ.pop(HYDRA_FULL_ERROR_ENV, None)
                else:
                    os.environ[HYDRA_FULL_ERROR_ENV] = before
            print(f"{command}: error: {one_line(message)}", file=sys.stderr)
            raise SystemExit(USER_ERROR_EXIT_CODE)

        return run  # type: ignore[return-value]

    return decorate


def hydra_command(command: str, config_name: str) -> Callable[[Callable[[Any], Any]], Callable[[], Any]]:
    """``@hydra.main`` on ``conf/<config_name>.yaml`` with :func:`user_errors` on both sides: the
    outer one sees Hydra's own errors, the inner one the task's (see the module docstring)."""

    def decorate(task: Callable[[Any], Any]) -> Callable[[], Any]:
        main = hydra.main(version_base=HYDRA_VERSION_BASE, config_path=CONFIG_PATH, config_name=config_name)
        return user_errors(command)(main(user_errors(command)(task)))

    return decorate
