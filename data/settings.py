"""The rules of settings that several commands share (system/checks.py): the conversation source
and its split (conf/data), torch threads. Each command's own table (next to its
entry point) includes these under the prefix where its config has them."""

from __future__ import annotations

from specdraft.system.checks import Rule, at_least, in_range, integer, one_of, optional

THREADS = optional(at_least(1))
SPLITS = one_of("train", "heldout", "all")


def source_rules(prefix: str) -> dict[str, Rule]:
    """A conversation reader's settings (conf/data/*.yaml ``source``): how many it reads."""
    return {
        f"{prefix}.limit": optional(at_least(1)),
        f"{prefix}.count": at_least(1),  # data=tiny
    }


def data_rules(prefix: str = "data") -> dict[str, Rule]:
    """A conf/data group: its source, the token cut and the held-out split."""
    return {
        **source_rules(f"{prefix}.source"),
        f"{prefix}.max_length": at_least(1),
        f"{prefix}.heldout_fraction": in_range(0, 1, closed=(True, False)),
        f"{prefix}.split_seed": integer(),
    }
