"""``specdraft-export``: a trained head in the format a decoder loads (Hydra).

    specdraft-export checkpoint=outputs/train/hass format=vllm
    specdraft-export checkpoint=outputs/train/eagle3-eagle3 format=speculators verifier=/models/SmolLM2
    specdraft-export checkpoint=outputs/train/hass/checkpoints/last.ckpt format=native out=exports/hass

``checkpoint`` is a training checkpoint, a run dir (its best checkpoint by simulated τ, from
``summary.json``, else ``checkpoints/last.ckpt``) or an export directory of any format (e.g. a
pretrained head in ``assets/heads/``, converted to an engine's layout). The head is checked against
the target it is exported for, converted (:mod:`specdraft.heads.formats`), read back from the
converted files and compared weight by weight, and only then written, atomically.
``format=llamacpp`` writes an EAGLE-3 head as the GGUF llama.cpp serves, through llama.cpp's own
converter (:mod:`specdraft.train.llamacpp`; ``make llamacpp`` fetches it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from specdraft.data.target import Target, target_weights
from specdraft.heads.formats import FORMATS, FormatError, read_checkpoint, read_export, write_export
from specdraft.heads.formats.files import CONFIG_FILE, check_destination
from specdraft.system.checks import at_least, check_settings, one_of, optional
from specdraft.system.errors import hydra_command
from specdraft.system.hardware import start
from specdraft.system.locks import output_lock
from specdraft.train.llamacpp import LLAMACPP_FORMAT, OUTTYPES, Converter, check_servable, write_gguf_export
from specdraft.train.run_dir import LAST_CHECKPOINT

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# specdraft-export settings (conf/export.yaml), checked before anything is read or written.
EXPORT_SETTINGS = {
    "format": one_of(*sorted(FORMATS), LLAMACPP_FORMAT),
    "dtype": optional(one_of(*DTYPES)),
    "overwrite": one_of(True, False),
    "speculative_tokens": at_least(1),
    "llamacpp.outtype": one_of(*OUTTYPES),
}


@hydra_command("specdraft-export", "export")
def main(cfg: DictConfig) -> None:
    export(cfg)


def export(cfg: DictConfig) -> Path:
    check_settings(cfg, EXPORT_SETTINGS)
    source = Path(cfg.checkpoint)
    from_export = (source / CONFIG_FILE).is_file()
    checkpoint = source if from_export else resolve_checkpoint(source)
    out = (
        Path(cfg.out)
        if cfg.out
        else Path(cfg.paths.log_dir) / "export" / f"{run_name(checkpoint)}-{cfg.format}"
    )
    with output_lock(out, "specdraft-export"):  # a sibling lock file: it outlives the rename into `out`
        return write_locked(cfg, checkpoint, from_export, out)


def write_locked(cfg: DictConfig, checkpoint: Path, from_export: bool, out: Path) -> Path:
    """Export ``checkpoint`` to ``out`` (whose lock this process holds)."""
    # Both checks before the target is loaded: fail in a second, not a minute. An export is read
    # after it, since a foreign layout takes the target's spec.
    check_destination(out, cfg.overwrite)
    record = None if from_export else read_checkpoint(checkpoint)
    gguf = cfg.format == LLAMACPP_FORMAT
    if gguf:
        if cfg.dtype is not None:
            raise FormatError(
                "format=llamacpp: the GGUF's weight type is llamacpp.outtype (f32/f16/bf16/q8_0), not dtype"
            )
        if record is not None:  # the head first: a converter would not make it servable
            check_servable(record)
        converter = Converter(Path(cfg.llamacpp.script), Path(cfg.llamacpp.python))
        converter.check()
    start("specdraft-export", target=cfg.target)
    target: Target = instantiate(cfg.target)
    target_lm_head = target_weights(target).lm_head
    if record is None:
        record = read_export(checkpoint, target.spec, target_lm_head=target_lm_head)
    if gguf:
        path = write_gguf_export(
            out,
            record,
            target=target,
            converter=converter,
            outtype=cfg.llamacpp.outtype,
            overwrite=cfg.overwrite,
        )
        log.info("exported the %s head of %s for llama.cpp: %s", record.kind, checkpoint, path)
        return path
    path = write_export(
        out,
        record,
        cfg.format,
        overwrite=cfg.overwrite,
        target_spec=target.spec,
        target_lm_head=target_lm_head,
        dtype=DTYPES[cfg.dtype] if cfg.dtype else None,
        speculative_tokens=cfg.speculative_tokens,
        verifier=cfg.verifier,
    )
    log.info("exported the %s head of %s as %s: %s", record.kind, checkpoint, cfg.format, path)
    return path


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint file as is; a run dir -> its best checkpoint (summary.json), else the last one."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint={path}: no such file or run directory")
    summary = path / "summary.json"
    if summary.is_file():
        best = json.loads(summary.read_text()).get("best_checkpoint")
        if best and Path(best).is_file():
            log.info("run dir %s: its best checkpoint by simulated tau, %s", path, best)
            return Path(best)
    last = path / LAST_CHECKPOINT
    if last.is_file():
        log.info("run dir %s: no best checkpoint recorded, exporting %s", path, last)
        return last
    raise FileNotFoundError(
        f"checkpoint={path}: a directory without summary.json's best checkpoint or {LAST_CHECKPOINT}"
    )


def run_name(checkpoint: Path) -> str:
    """The training run's name for a checkpoint inside ``<run>/checkpoints/``, else the file's
    stem (an export directory: its name)."""
    if checkpoint.is_dir():
        return checkpoint.name
    return checkpoint.parent.parent.name if checkpoint.parent.name == "checkpoints" else checkpoint.stem


if __name__ == "__main__":
    main()
