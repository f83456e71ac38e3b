"""Setups and checks of the probes in scripts/probe_catalogue.py (scripts/probe_user_errors.py).

Each probe is one command line of a console script, run in its own empty directory (``<t>``) on
the tiny target, and what a correct outcome is: ``refuse`` (exit 2, one stderr line
``<command>: error: …`` naming ``fragments``: the key or the file a user must fix) or ``accept``
(exit 0, then ``check``: nothing written outside outputs, nothing lost, no duplicate record).
``race`` runs the command twice at once: one may run, the other must be refused in one line, and
``check`` must find nothing mixed. Placeholders in arguments: ``<t>`` the probe's directory,
``<ckpt>`` / ``<run>`` / ``<cache>`` / ``<heldout>`` / ``<export>`` / ``<repo>`` the shared fixtures.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Setup = Callable[[Path, dict], None]
Check = Callable[[Path, dict, list], str | None]  # a failure's description, or None


@dataclass(frozen=True)
class Probe:
    id: str
    command: str  # specdraft-<command>
    args: tuple[str, ...]
    expect: str = "refuse"  # refuse | accept | race
    fragments: tuple[str, ...] = ()
    setup: Setup | None = None
    check: Check | None = None
    before: tuple[tuple[str, ...], ...] = ()  # command lines run first (outcome recorded, not judged)
    between: Setup | None = None  # after ``before``: e.g. damage what it wrote
    timeout: float = 90.0
    needs: str = ""  # root-chmod | immutable: skipped where the machine cannot make the condition
    kind: str = ""  # what the issue calls it (bad value, unknown key, file, resume, names, …)
    second: tuple[str, ...] = ()  # race: what the second process adds to its command line


# ---- command-line prefixes (tiny target, seconds each) -------------------------------------
PREP = ("target=tiny_random", "data=tiny", "sample_conversations=8", "progress=false")
CACHE = ("target=tiny_random", "data=tiny", "limit=8", "progress=false", "out_dir=<t>/cache")
REGEN = (
    "target=tiny_random",
    "data=tiny",
    "limit=3",
    "max_turns=1",
    "batch_size=2",
    "generation.max_new_tokens=4",
    "progress=false",
    "out_path=<t>/regen.jsonl",
    "+target.initializer_range=0.5",
)  # the default init answers with an empty string
TRAIN = ("experiment=eagle", "debug=smoke")
CACHED = (*TRAIN, "datamodule=cached", "datamodule.train_cache=<t>/mycache", "datamodule.val_cache=<heldout>")
EXPORT = ("target=tiny_random", "checkpoint=<ckpt>", "out=<t>/myexport")
EVAL = (
    "target=tiny_random",
    "prompts=tiny",
    "checkpoint=<ckpt>",
    "shortlist.size=null",
    "max_new_tokens=8",
    "temperatures=[0.0]",
    "warmup=false",
    "progress=false",
)
BENCH = (*EVAL, "methods=head")
TINY_STAGES = tuple(
    f"overrides.{stage}=['target=tiny_random']" for stage in ("regen", "cache", "train", "export", "eval")
)
QUICK = ("paths.log_dir=<t>/outputs", *TINY_STAGES)
JSONL = ("data=jsonl", "data.source.path=<t>/chats.jsonl")
SPEC = ("prompts=mt_bench", "prompts.path=<t>/prompts.jsonl", "prompts.categories=null")


RUN = "outputs/train/smoke-eagle-eagle"  # where `specdraft-train experiment=eagle debug=smoke` runs


# ---- setups ----------------------------------------------------------------------------------
def chat(i: int, assistant: bool = True) -> dict:
    turns = [{"role": "user", "content": f"Count to {i + 3}."}]
    if assistant:
        turns.append({"role": "assistant", "content": " ".join(str(n) for n in range(1, i + 4))})
    return {"id": f"c{i}", "messages": turns}


def chats(data: bytes | None = None, assistant: bool = True) -> Setup:
    """<t>/chats.jsonl: ten good conversations, or ``data`` as is."""
    text = "".join(json.dumps(chat(i, assistant)) + "\n" for i in range(10)).encode()
    return lambda t, fx: (t / "chats.jsonl").write_bytes(text if data is None else data)


def prompts(data: bytes | None = None, ids: list[int] | None = None) -> Setup:
    """<t>/prompts.jsonl in Spec-Bench style (``ids``: the question ids, repeats allowed)."""
    ids = ids if ids is not None else [1, 2, 3]
    text = "".join(
        json.dumps({"question_id": i, "category": "writing", "turns": [f"Count to {n + 3}."]}) + "\n"
        for n, i in enumerate(ids)
    ).encode()
    return lambda t, fx: (t / "prompts.jsonl").write_bytes(text if data is None else data)


def put(name: str, data: bytes) -> Setup:
    def setup(t: Path, fx: dict) -> None:
        (t / name).parent.mkdir(parents=True, exist_ok=True)
        (t / name).write_bytes(data)

    return setup


def steps(*setups: Setup) -> Setup:
    def setup(t: Path, fx: dict) -> None:
        for one in setups:
            one(t, fx)

    return setup


def truncated_copy(source: str, name: str) -> Setup:
    """<t>/name: the first half of the fixture file ``source``."""

    def setup(t: Path, fx: dict) -> None:
        data = Path(fx[source]).read_bytes()
        (t / name).write_bytes(data[: len(data) // 2])

    return setup


def saved(name: str, obj: object) -> Setup:
    def setup(t: Path, fx: dict) -> None:
        import torch  # here: the catalogue loads without torch (tests/test_probe_catalogue.py)

        torch.save(obj, t / name)

    return setup


class Marker:
    """Unpickling it creates a file: a checkpoint that runs code when loaded without weights_only."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def malicious(name: str) -> Setup:
    def setup(t: Path, fx: dict) -> None:
        with (t / name).open("wb") as handle:
            pickle.dump({"state_dict": {}, "payload": Marker(str(t / "PWNED"))}, handle)

    return setup


def cache_copy(mutate: Callable[[Path], None] | None = None, name: str = "c") -> Setup:
    """<t>/<name>: a copy of the fixture cache, then ``mutate``(its dir)."""

    def setup(t: Path, fx: dict) -> None:
        shutil.copytree(fx["cache"], t / name)
        if mutate:
            mutate(t / name)

    return setup


def edit_manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(cache: Path) -> None:
        manifest = json.loads((cache / "manifest.json").read_text())
        edit(manifest)
        (cache / "manifest.json").write_text(json.dumps(manifest))

    return mutate


def lie_offsets(manifest: dict) -> None:
    shard = manifest["shards"][0]
    shard["offsets"][1:-1] = [o + 7 for o in shard["offsets"][1:-1]]


def lie_totals(manifest: dict) -> None:
    manifest["num_tokens"] += 1000
    manifest["num_samples"] += 3


def rewrite_shard(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Change shard 0's tensors and re-record its size and SHA-256: a shard that passes its hash."""

    def mutate(cache: Path) -> None:
        import hashlib

        from safetensors.torch import load_file, save_file

        path = cache / "shard-00000.safetensors"
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path))
        digest, size = hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size
        manifest = json.loads((cache / "manifest.json").read_text())
        manifest["shards"][0].update(sha256=digest, bytes=size)
        (cache / "manifest.json").write_text(json.dumps(manifest))
        side = cache / "shard-00000.json"
        if side.exists():
            record = json.loads(side.read_text())
            record.update(sha256=digest, bytes=size)
            side.write_text(json.dumps(record))

    return mutate


def nan_hidden(tensors: dict) -> None:
    tensors["hidden"][3:9] = float("nan")


def drop_mask(tensors: dict) -> None:
    del tensors["loss_mask"]


def run_copy(mutate: Callable[[Path], None] | None = None, at: str = RUN, copy: bool = True) -> Setup:
    """<t>/<at>: a copy of the fixture run, then ``mutate``; ``copy=False``: the run already there.
    (A resumed run must be trained in place: its config holds its absolute paths.)"""

    def setup(t: Path, fx: dict) -> None:
        run = t / at
        if copy:
            shutil.copytree(fx["run"], run)
        if mutate:
            mutate(run)

    return setup


def truncate(relative: str) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        path = root / relative
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return mutate


def export_copy(name: str = "exp", mutate: Callable[[Path], None] | None = None) -> Setup:
    def setup(t: Path, fx: dict) -> None:
        shutil.copytree(fx["export"], t / name)
        if mutate:
            mutate(t / name)

    return setup


def foreign_dir(t: Path, fx: dict) -> None:
    (t / "mine").mkdir()
    (t / "mine" / "thesis.txt").write_text("three years of work\n")


def a_file(t: Path, fx: dict) -> None:
    (t / "afile").write_text("a file, not a directory\n")


def locked(relative: str) -> Setup:
    """<t>/relative: a directory the runner then makes unwritable (chmod, or chattr +i) after the
    setup, as the probe's ``needs`` says; its ``locked`` attribute names it."""

    def setup(t: Path, fx: dict) -> None:
        (t / relative).mkdir(parents=True, exist_ok=True)

    setup.locked = relative  # type: ignore[attr-defined]
    return setup


# ---- checks ----------------------------------------------------------------------------------
def only_under(*allowed: str) -> Check:
    """Nothing new outside ``allowed`` (paths relative to <t>; a file's side files, <name>.*, too)."""

    def check(t: Path, fx: dict, new: list) -> str | None:
        outside = [p for p in new if not any(p == a or p.startswith((a + "/", a + ".")) for a in allowed)]
        return f"wrote outside {allowed}: {outside[:3]}" if outside else None

    return check


def all_of(*checks: Check) -> Check:
    def check(t: Path, fx: dict, new: list) -> str | None:
        return next((f for c in checks if (f := c(t, fx, new))), None)

    return check


def survives(relative: str, text: str) -> Check:
    def check(t: Path, fx: dict, new: list) -> str | None:
        path = t / relative
        return None if path.is_file() and path.read_text() == text else f"lost: {relative}"

    return check


def no_marker(t: Path, fx: dict, new: list) -> str | None:
    return "a checkpoint ran code (PWNED written)" if (t / "PWNED").exists() else None


def no_staging(t: Path, fx: dict, new: list) -> str | None:
    left = [p for p in new if ".partial" in p]
    return f"staging left behind: {left[:2]}" if left else None


def unique_records(t: Path, fx: dict, new: list) -> str | None:
    """Each bench records.jsonl holds each (question, method, temperature, turn) once."""
    for path in (t / "outputs" / "bench").rglob("records.jsonl"):
        keys = []
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                keys.append(json.dumps([r.get(k) for k in ("question_id", "method", "temperature", "turn")]))
        if len(keys) != len(set(keys)):
            return f"{path.relative_to(t)}: {len(keys) - len(set(keys))} duplicate records"
    return None


def no_versioned_checkpoints(t: Path, fx: dict, new: list) -> str | None:
    mixed = [p for p in new if "-v1" in p or "-v2" in p]
    return f"two runs mixed in one dir: {mixed[:3]}" if mixed else None


def lines_of(relative: str, count: int) -> Check:
    def check(t: Path, fx: dict, new: list) -> str | None:
        path = t / relative
        if not path.is_file():
            return f"{relative} missing"
        ids = [json.loads(line).get("id") for line in path.read_text().splitlines() if line.strip()]
        return None if len(ids) == count == len(set(ids)) else f"{relative}: {len(ids)} records, want {count}"

    return check


def unchanged(relative: str) -> Check:
    """``relative`` (under <t>) the same bytes as before the command (the runner keeps a copy)."""

    def check(t: Path, fx: dict, new: list) -> str | None:
        kept = t.parent / f"{t.name}.before" / relative
        return None if (t / relative).read_bytes() == kept.read_bytes() else f"{relative} rewritten"

    return check


def global_step(n: int) -> Check:
    def check(t: Path, fx: dict, new: list) -> str | None:
        summary = t / "outputs/train/smoke-eagle-eagle/summary.json"
        step = json.loads(summary.read_text()).get("global_step")
        return None if step == n else f"global_step {step}, want {n}"

    return check


OUT = only_under("outputs")
BAD = b'{"id": "c0", "messages": [{"role": "user", "content": "caf\xe9"}]}\n\xff\xfe\n'
SHAPE = "methods.head.shape="
