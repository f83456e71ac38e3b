"""Settings checked at a command's boundary: every numeric and enum setting, once, before any work.

Each command keeps ONE table of rules next to its entry point (dotted key → :class:`Rule`) and
calls :func:`check_settings` as the first line of its work, before a target loads or a file is
written. Every violation of the table is reported together, in one :class:`SettingsError` (a
``ValueError``: one line, exit code 2 under ``system.errors.user_errors``), each as
``key=value: expected …`` with the allowed range. A key the composed config does not have (a group
without it, a mandatory ``???`` not given) is skipped; ``*`` as a key's last part applies the rule to
every child of the mapping before it (``loss.weights.*``). The defaults stay in conf/*.yaml: a
rule only says what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

_ABSENT = object()  # what OmegaConf.select returns for a key the config lacks


class SettingsError(ValueError):
    """Settings outside their allowed values (all of a command's, in one message)."""


@dataclass(frozen=True)
class Rule:
    """What a setting may be: ``expected`` says it in words, ``accepts`` decides."""

    expected: str
    accepts: Callable[[Any], bool]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def at_least(low: float, integer: bool = True) -> Rule:
    """An integer (or, ``integer=False``, a number) ≥ ``low``."""
    kind = _integer if integer else _number
    return Rule(f"{'an integer' if integer else 'a number'} >= {low}", lambda v: kind(v) and v >= low)


def greater_than(low: float) -> Rule:
    """A finite number > ``low``."""
    return Rule(f"a number > {low}", lambda v: _number(v) and v > low)


def in_range(low: float, high: float, closed: tuple[bool, bool] = (True, True)) -> Rule:
    """A finite number within ``low`` .. ``high``; ``closed`` says whether each end is allowed."""
    left, right = ("[" if closed[0] else "("), ("]" if closed[1] else ")")

    def accepts(value: Any) -> bool:
        if not _number(value):
            return False
        above = value >= low if closed[0] else value > low
        below = value <= high if closed[1] else value < high
        return above and below

    return Rule(f"a number in {left}{low}, {high}{right}", accepts)


def integer() -> Rule:
    """Any integer (seeds)."""
    return Rule("an integer", _integer)


def one_of(*values: Any) -> Rule:
    """One of ``values`` exactly (``True`` is not ``1``)."""

    def accepts(value: Any) -> bool:
        return any(value == v and type(value) is type(v) for v in values)

    return Rule(f"one of {', '.join(map(_show, values))}", accepts)


def optional(rule: Rule) -> Rule:
    """null, or what ``rule`` accepts."""
    return Rule(f"null or {rule.expected}", lambda v: v is None or rule.accepts(v))


def either(*rules: Rule) -> Rule:
    """What any of ``rules`` accepts."""
    return Rule(" or ".join(r.expected for r in rules), lambda v: any(r.accepts(v) for r in rules))


def each(rule: Rule) -> Rule:
    """A non-empty list whose every item ``rule`` accepts."""

    def accepts(value: Any) -> bool:
        return (
            isinstance(value, Sequence)
            and not isinstance(value, str)
            and bool(value)
            and all(rule.accepts(v) for v in value)
        )

    return Rule(f"a non-empty list, each {rule.expected}", accepts)


def from_text(rule: Rule) -> Rule:
    """``rule`` on an integer that may arrive as text (a setting read from the environment)."""

    def accepts(value: Any) -> bool:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                return False
        return rule.accepts(value)

    return Rule(rule.expected, accepts)


def violations(cfg: DictConfig, rules: Mapping[str, Rule]) -> list[str]:
    """``key=value: expected …`` for every setting of ``cfg`` that its rule refuses."""
    found = []
    for key, rule in rules.items():
        for name, value in _values(cfg, key):
            if isinstance(value, DictConfig | ListConfig):
                value = OmegaConf.to_container(value, resolve=True)
            if not rule.accepts(value):
                found.append(f"{name}={_show(value)}: expected {rule.expected}")
    return found


def check_settings(cfg: DictConfig, rules: Mapping[str, Rule], extra: Sequence[str] = ()) -> None:
    """Raise :class:`SettingsError` listing every violation of ``rules`` in ``cfg`` (and the
    ``extra`` ones a command found itself), or return."""
    found = [*violations(cfg, rules), *extra]
    if found:
        raise SettingsError(
            f"{len(found)} invalid setting{'s' if len(found) > 1 else ''}: " + "; ".join(found)
        )


def _values(cfg: DictConfig, key: str) -> list[tuple[str, Any]]:
    if not key.endswith(".*"):
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        return [] if value is _ABSENT else [(key, value)]
    parent = key[:-2]
    node = OmegaConf.select(cfg, parent, default=_ABSENT)
    if not isinstance(node, DictConfig):
        return []
    return [(f"{parent}.{child}", OmegaConf.select(node, str(child))) for child in node]


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
