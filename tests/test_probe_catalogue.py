"""scripts/probe_catalogue.py, the probes of the user-error sweep (scripts/probe_user_errors.py):
well-formed, so that a sweep covers every command and its verdicts can be read."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def probes():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from probe_catalogue import PROBES
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return PROBES


def test_probes_have_unique_ids_and_cover_every_command(probes):
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    commands = {name.removeprefix("specdraft-") for name in scripts}
    assert [i for i, n in Counter(p.id for p in probes).items() if n > 1] == []
    assert {p.command for p in probes} == commands
    assert len(probes) >= 100


def test_every_probe_says_what_a_correct_outcome_is(probes):
    for probe in probes:
        assert probe.expect in ("refuse", "accept", "race"), probe.id
        if probe.expect == "refuse":
            assert probe.fragments and all(probe.fragments), probe.id  # the key or file to name
        assert probe.needs in ("", "root-chmod", "immutable"), probe.id
        if probe.needs:
            assert hasattr(probe.setup, "locked"), probe.id  # the directory made unwritable
