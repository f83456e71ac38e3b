"""A training run directory: its config, and whether re-running a command resumes it.

The first start writes ``run_config.yaml`` (the resolved config). A later start in the same
directory resumes from ``checkpoints/last.ckpt`` only if its config equals the stored one
outside ``resume_ignore`` (run length, loggers, callbacks, …); otherwise it stops with the list of
differing keys, so a changed experiment never continues an old run or overwrites its files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from specdraft.system.files import setting_differences, write_bytes_atomic

RUN_CONFIG = "run_config.yaml"
LAST_CHECKPOINT = "checkpoints/last.ckpt"
FINAL_CHECKPOINT = "checkpoints/final-step={step}.ckpt"  # the final weights, when they are the best


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
        differences = setting_differences(stored, config, [*ignore, "resume_ignore"])
        if differences and checkpoint.is_file():
            shown = "\n  ".join(differences[:12]) + ("\n  …" if len(differences) > 12 else "")
            raise RunDirError(
                f"{run_dir} holds a run with a different config:\n  {shown}\nPick another run_name=… "
                "(or hydra.run.dir=…) to start a new run; the existing one is left untouched"
            )
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
