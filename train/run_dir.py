"""A training run directory: its config, and whether re-running a command resumes it.

The first start writes ``run_config.yaml`` (the resolved config). A later start in the same
directory resumes from ``checkpoints/last.ckpt`` only if its config equals the stored one
outside the resume rule's output-neutral keys (system/files.py) and ``resume_ignore`` (run length,
callbacks, …); otherwise it stops with the list of differing keys, so a changed experiment never
continues an old run or overwrites its files. A stored config binds only once a checkpoint exists:
a run refused or killed before its first one leaves nothing that blocks the next.

One process at a time: :func:`lead_process` tells the process that holds the run dir's lock
(system/locks.py) from the ones a distributed strategy starts for its other ranks.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from specdraft.system.files import OUTPUT_NEUTRAL, setting_differences, write_bytes_atomic

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.yaml"
LAST_CHECKPOINT = "checkpoints/last.ckpt"
FINAL_CHECKPOINT = "checkpoints/final-step={step}.ckpt"  # the final weights, when they are the best
# Set by launchers (torchrun, Lightning's DDP launcher, SLURM) in the processes of a distributed run.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


class RunDirError(ValueError):
    pass


def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, dict):
        flat: dict[str, Any] = {}
        for key, value in config.items():
            flat.update(flatten_config(value, f"{prefix}{key}."))
        return flat or {prefix[:-1]: {}}
    return {prefix[:-1]: config}


def prepare_run_dir(
    run_dir: Path, config: dict[str, Any], resume: str | bool, ignore: list[str]
) -> str | None:
    """Checks the run dir against ``config``; returns the checkpoint to resume from (or None).

    resume: "auto" resumes a matching run if there is one; True requires one; False refuses a
    run dir that already holds checkpoints.
    """
    checkpoint = run_dir / LAST_CHECKPOINT
    stored_path = run_dir / RUN_CONFIG
    if resume not in ("auto", True, False):
        raise RunDirError(f"resume must be auto, true or false, got {resume!r}")
    if stored_path.is_file():
        stored = yaml.safe_load(stored_path.read_text())
        # The resume rule of system/files.py; the keys that may change are the config's resume_ignore.
        differences = setting_differences(stored, config, [*OUTPUT_NEUTRAL, *ignore, "resume_ignore"])
        if differences and any((run_dir / "checkpoints").glob("*.ckpt")):
            shown = "\n  ".join(differences[:12]) + ("\n  …" if len(differences) > 12 else "")
            raise RunDirError(
                f"{run_dir} holds a run with a different config:\n  {shown}\nPick another run_name=… "
                "(or hydra.run.dir=…) to start a new run; the existing one is left untouched"
            )
        if differences:
            log.info("%s: its stored config has no checkpoint yet; this run's replaces it", stored_path)
    if checkpoint.is_file():
        if resume is False:
            raise RunDirError(
                f"{checkpoint} exists and resume=false; pick another run_name to start a new run"
            )
        return str(checkpoint)
    if resume is True:
        raise RunDirError(f"resume=true but {checkpoint} does not exist")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(stored_path, yaml.safe_dump(config, sort_keys=False).encode())
    return None


def lead_process() -> bool:
    """Whether this is the process a user started, not one a distributed launcher started for
    another rank (those re-run the command inside the lead's lock)."""
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)
