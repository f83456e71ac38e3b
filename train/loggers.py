"""Experiment loggers that never block a run on the network."""

from __future__ import annotations

import netrc
import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger

DEFAULT_WANDB_HOST = "https://api.wandb.ai"


def has_wandb_credentials() -> bool:
    """True when W&B could log in without asking: WANDB_API_KEY, or a ~/.netrc entry for the
    W&B host (what `wandb login` writes). Checked locally, no network."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", DEFAULT_WANDB_HOST)).hostname
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):
        return False


def wandb_mode(mode: str) -> str:
    """``auto`` -> ``online`` with credentials, else ``offline``; WANDB_MODE, when set, wins."""
    if mode not in ("auto", "online", "offline"):
        raise ValueError(f"logger.wandb.mode must be auto, online or offline, got {mode!r}")
    forced = os.environ.get("WANDB_MODE")
    if forced:
        return forced
    if mode == "auto":
        return "online" if has_wandb_credentials() else "offline"
    return mode


def wandb_logger(
    project: str,
    name: str,
    save_dir: str,
    mode: str = "auto",
    group: str | None = None,
    tags: Sequence[str] = (),
    entity: str | None = None,
) -> WandbLogger:
    """A Lightning WandbLogger, offline unless credentials exist (``wandb sync`` uploads later)."""
    resolved = wandb_mode(mode)
    return WandbLogger(
        project=project,
        name=name,
        save_dir=save_dir,
        offline=resolved == "offline",
        group=group,
        tags=list(tags),
        entity=entity,
    )


def finish_loggers(loggers: Sequence[object]) -> None:
    """Close W&B runs: a Hydra multirun trains several runs in one process, and a W&B run left
    open would swallow the next one's metrics."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger.experiment.finish()
