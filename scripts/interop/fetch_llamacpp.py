"""Fetch llama.cpp's HF → GGUF converter (``make llamacpp``), pinned, from the package registry.

    python scripts/interop/fetch_llamacpp.py .cache/llama.cpp

The converter is not on PyPI by itself, and PyPI's ``gguf`` lacks the EAGLE-3 constants; the
llama-cpp-python sdist vendors the whole llama.cpp tree with both. This downloads that one sdist
(no build), checks its sha256 against the pin below, and unpacks only the converter: the script,
its ``conversion`` package and its own ``gguf-py``. The destination is written atomically (staged
beside it, renamed into place), so an interrupted fetch leaves nothing that looks complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TREE = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# What the converter imports from its own tree; everything else in the sdist (llama.cpp's C++
# sources, the Python bindings) is left packed.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
MARKER = "FETCHED"  # written last: a destination holding it is complete
DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 300


def sdist_url(index: str) -> str:
    """The sdist's download URL from the index's JSON simple API (PEP 691)."""
    request = urllib.request.Request(
        f"{index.rstrip('/')}/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        files = json.load(response)["files"]
    for file in files:
        if file["filename"] == SDIST:
            return file["url"]
    raise SystemExit(f"{index}: {PACKAGE} has no {SDIST}")


def download(url: str, into: Path) -> Path:
    path = into / SDIST
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, path.open("wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != SHA256:
        raise SystemExit(f"{url}: sha256 {digest.hexdigest()}, expected the pinned {SHA256}")
    return path


def unpack_converter(sdist: Path, into: Path) -> None:
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            if not member.name.startswith(TREE):
                continue
            relative = member.name[len(TREE) :]
            if not relative.startswith(CONVERTER_PARTS) or not (member.isfile() or member.isdir()):
                continue
            member.name = relative
            archive.extract(member, into, filter="data")
    if not (into / CONVERTER_PARTS[0]).is_file():
        raise SystemExit(f"{sdist}: no {TREE}{CONVERTER_PARTS[0]} inside")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the converter's directory (created)")
    parser.add_argument("--index", default=os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX))
    args = parser.parse_args()
    dest: Path = args.dest
    pinned = f"{PACKAGE}=={VERSION} sha256:{SHA256}"
    marker = dest / MARKER
    fetched = marker.read_text().strip() if marker.is_file() else None
    if fetched == pinned:
        print(f"{dest}: llama.cpp's converter from {PACKAGE} {VERSION} is already there")
        return
    if dest.exists() and fetched is None:
        raise SystemExit(f"{dest}: exists but is not a complete fetch of ours (no {MARKER}); remove it first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.partial-") as staging:
        staging = Path(staging)
        sdist = download(sdist_url(args.index), staging)
        tree = staging / "tree"
        unpack_converter(sdist, tree)
        (tree / MARKER).write_text(pinned + "\n")
        if fetched is not None:  # another pinned version of ours: set aside, replaced, removed
            dest.rename(staging / "old")
        tree.rename(dest)
    print(f"{dest}: llama.cpp's converter from {PACKAGE} {VERSION}", file=sys.stderr)


if __name__ == "__main__":
    main()
