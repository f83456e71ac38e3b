"""Shared fixtures. The default tier runs on the tiny in-memory target and never downloads."""

from __future__ import annotations

import importlib.util

import pytest

from specdraft.data.target import Target
from specdraft.data.tiny import tiny_random_target


@pytest.fixture(scope="session")
def tiny_target() -> Target:
    return tiny_random_target(seed=0)


def requires_package(name: str) -> pytest.MarkDecorator:
    """Skip unless the (--no-deps) asset package ``name`` is installed (`make install-assets`)."""
    return pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is not installed")
