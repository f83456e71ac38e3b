"""The machine a command runs on, and the numeric choices that follow from it.

bf16 pays only where the hardware computes it natively: CUDA GPUs with bf16, and CPUs with
AMX-bf16 or AVX-512-bf16 (there ~3× fp32). On a CPU without them (an AVX2-only AMD EPYC) torch
emulates bf16: one 2,048-token EAGLE step under bf16 autocast did not finish in 8 minutes, against
~20 s in fp32. One predicate, :attr:`Hardware.fast_bf16`, therefore decides both ``dtype: auto``
(the frozen target's weights) and ``precision: auto`` (the trainer's), so the two never disagree.

Every command calls :func:`start` first: it sets torch's threads and logs one line naming the
CPU model (or GPU), the flags that decided, the dtype / precision chosen and the threads.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# CPU flags (as /proc/cpuinfo spells them) under which bf16 matmuls run natively.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# The CPU vector extensions worth naming in a log line or a benchmark record.
VECTOR_CPU_FLAGS = ("avx2", "avx512f", *BF16_CPU_FLAGS)
CPUINFO = Path("/proc/cpuinfo")
AUTO = "auto"
BF16_PRECISION = "bf16-mixed"
FULL_PRECISION = "32-true"


@dataclass(frozen=True)
class Hardware:
    """What decides the numerics: the device, its name, and whether bf16 is native on it."""

    device_type: str  # "cpu" or "cuda"
    name: str  # the CPU model name or the GPU name
    cpu_flags: tuple[str, ...] = ()  # the VECTOR_CPU_FLAGS this CPU has
    cuda_bf16: bool = False

    @property
    def fast_bf16(self) -> bool:
        if self.device_type == "cuda":
            return self.cuda_bf16
        return any(flag in self.cpu_flags for flag in BF16_CPU_FLAGS)

    def reason(self) -> str:
        """Why bf16 is or is not used, in words a log reader can check."""
        if self.device_type == "cuda":
            return "bf16 supported" if self.cuda_bf16 else "no bf16 support"
        present = [flag for flag in BF16_CPU_FLAGS if flag in self.cpu_flags]
        vector = ", ".join(self.cpu_flags) or "no AVX2/AVX-512"
        if present:
            return f"{vector}: bf16 native ({', '.join(present)})"
        return f"{vector}: no {' / '.join(BF16_CPU_FLAGS)}, bf16 would be emulated"

    def record(self) -> dict[str, object]:
        """The JSON-able facts a benchmark report keeps."""
        return {
            "device_type": self.device_type,
            "name": self.name,
            "cpu_flags": list(self.cpu_flags),
            "fast_bf16": self.fast_bf16,
        }


def read_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """The CPU model name and the :data:`VECTOR_CPU_FLAGS` present, from /proc/cpuinfo text."""
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, tuple(flag for flag in VECTOR_CPU_FLAGS if flag in flags)


def detect_hardware(device: str | torch.device = "cpu", cpuinfo: str | None = None) -> Hardware:
    """The hardware behind ``device``. ``cpuinfo`` replaces /proc/cpuinfo (tests inject flags)."""
    if torch.device(device).type == "cuda":
        return Hardware("cuda", torch.cuda.get_device_name(device), (), torch.cuda.is_bf16_supported())
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:  # not Linux: no flags to read, so no bf16 claimed
            cpuinfo = ""
    name, flags = read_cpuinfo(cpuinfo)
    return Hardware("cpu", name or platform.processor() or platform.machine(), flags)


def resolve_dtype(
    dtype: str | torch.dtype, device: str | torch.device = "cpu", hardware: Hardware | None = None
) -> torch.dtype:
    """``"auto"`` → bf16 where the hardware computes it natively, else fp32 (fp16 on a CUDA GPU
    without bf16, for inference); any other value names a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != AUTO:
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. bfloat16, float32, auto)")
        return resolved
    hardware = hardware or detect_hardware(device)
    if hardware.fast_bf16:
        return torch.bfloat16
    return torch.float16 if hardware.device_type == "cuda" else torch.float32


def accelerator_device(accelerator: str) -> str:
    """The torch device type a Lightning ``accelerator`` setting trains on."""
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    if accelerator == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def resolve_precision(
    precision: str | int, accelerator: str = "cpu", hardware: Hardware | None = None
) -> str:
    """``"auto"`` → ``bf16-mixed`` where bf16 is native (the same rule as the target's
    ``dtype: auto``), ``32-true`` otherwise; any other value is Lightning's and passes through."""
    if precision != AUTO:
        return str(precision)
    hardware = hardware or detect_hardware(accelerator_device(accelerator))
    return BF16_PRECISION if hardware.fast_bf16 else FULL_PRECISION


@dataclass(frozen=True)
class Startup:
    """What :func:`start` found and chose (None where the command chooses no dtype / precision)."""

    hardware: Hardware
    dtype: torch.dtype | None = None
    precision: str | None = None


def start(
    command: str,
    threads: int | None = None,
    target: Mapping[str, Any] | None = None,
    precision: str | None = None,
    accelerator: str = "cpu",
) -> Startup:
    """What every command does first: set torch's intra-op threads (None keeps torch's default,
    one per core), detect the hardware, resolve the ``target`` config's ``dtype`` and the
    trainer's ``precision``, and log one line with what was chosen and why."""
    if threads:
        torch.set_num_threads(threads)
    device = (target or {}).get("device", "cpu")
    hardware = detect_hardware(device)
    dtype = (target or {}).get("dtype")
    resolved_dtype = resolve_dtype(dtype, device, hardware) if dtype is not None else None
    resolved_precision = None
    if precision is not None:
        same_device = accelerator_device(accelerator) == hardware.device_type
        resolved_precision = resolve_precision(precision, accelerator, hardware if same_device else None)
    chosen = []
    if resolved_dtype is not None:
        chosen.append(f"dtype {dtype} → {str(resolved_dtype).removeprefix('torch.')}")
    if resolved_precision is not None:
        chosen.append(f"precision {precision} → {resolved_precision}")
    chosen.append(f"{torch.get_num_threads()} torch threads")
    log.info("%s on %s (%s); %s", command, hardware.name, hardware.reason(), "; ".join(chosen))
    return Startup(hardware, resolved_dtype, resolved_precision)
