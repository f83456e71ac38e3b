"""A newcomer's path README → docs/architecture.md → code has no dangling reference: every file
the docs name exists, every dotted name of ours the docs or the code's comments cite imports,
and every "docs/architecture.md §n" a comment cites is a section of that file."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("system", "heads", "data", "train", "eval", "recipes", "conf")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [
    path for package in (*PACKAGES, "scripts", "tests") for path in sorted((ROOT / package).rglob("*.py"))
]

# `some/path.ext` in backticks (a path with a folder), and the targets of markdown links.
QUOTED_PATH = re.compile(r"`((?:\.\./)?[\w.-]+/[\w./-]*\.(?:py|md|yaml|json|jsonl|png|toml|sh|txt))`")
LINK = re.compile(r"\]\(([^)#\s]+)\)")
# specdraft.heads.rollout, or heads.registry.HEAD_KINDS (a package of ours, then attributes).
DOTTED = re.compile(r"\b((?:specdraft\.)?(?:system|heads|data|train|eval|recipes)(?:\.[A-Za-z_]\w*)+)")
SECTION_CITE = re.compile(r"architecture\.md §(\d+)")


def resolves(name: str) -> bool:
    """Whether ``name`` (with or without the ``specdraft.`` prefix) is a module of ours, or an
    attribute chain below one."""
    parts = name.removeprefix("specdraft.").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("specdraft." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def quoted_names(text: str) -> set[str]:
    """Dotted names of ours inside backticks (prose like "data.heldout_fraction" is config keys)."""
    return {match for quoted in re.findall(r"`([^`\n]+)`", text) for match in DOTTED.findall(quoted)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc):
    text = doc.read_text()
    missing = []
    for path in QUOTED_PATH.findall(text):
        if path.startswith(("../shared/", "outputs/")):
            continue  # the workplace's shared folder; what running a command writes
        if not (ROOT / path).exists() and not any((ROOT / package / path).exists() for package in PACKAGES):
            missing.append(path)
    for link in LINK.findall(text):
        if "://" not in link and not (doc.parent / link).exists():
            missing.append(link)
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_name_a_doc_cites_imports(doc):
    dangling = sorted(name for name in quoted_names(doc.read_text()) if not resolves(name))
    assert not dangling, f"{doc.name} cites names that do not exist: {dangling}"


def test_every_name_the_code_cites_in_comments_imports():
    dangling = []
    for path in CODE:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            comment = line.split("#", 1)[1] if "#" in line else ""
            cited = quoted_names(line) | set(DOTTED.findall(comment))
            dangling += [f"{path.relative_to(ROOT)}:{number}: {name}" for name in cited if not resolves(name)]
    assert not dangling, "\n".join(dangling)


def test_every_section_the_code_cites_exists():
    sections = set(re.findall(r"^## (\d+)\.", (ROOT / "docs" / "architecture.md").read_text(), re.MULTILINE))
    cited = {
        f"{path.relative_to(ROOT)}: §{number}"
        for path in [*CODE, *DOCS]
        for number in SECTION_CITE.findall(path.read_text())
        if number not in sections
    }
    assert not cited, sorted(cited)


def test_a_dangling_name_is_caught():
    assert resolves("specdraft.heads.rollout.rollout") and resolves("eval.methods.drafter_for_head")
    assert not resolves("specdraft.train.rollout") and not resolves("heads.registry.NO_SUCH_NAME")
