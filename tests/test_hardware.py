"""The hardware rule behind ``dtype: auto`` and ``precision: auto``, with the CPU flags injected
(the machine running the tests decides nothing here)."""

import logging

import pytest
import torch

from specdraft.system.hardware import (
    Hardware,
    detect_hardware,
    read_cpuinfo,
    resolve_dtype,
    resolve_precision,
    start,
)

# Abridged /proc/cpuinfo of the two CPUs this project runs on (two cores each; flags trimmed).
INTEL_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
"""
AMD_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2 sha_ni
"""
AVX512_NO_BF16 = """model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu avx avx2 avx512f avx512bw avx512vl
"""


def test_cpuinfo_is_read_for_the_model_name_and_the_flags_that_matter():
    assert read_cpuinfo(INTEL_AMX) == (
        "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
        ("avx2", "avx512f", "amx_bf16", "avx512_bf16"),
    )
    assert read_cpuinfo(AMD_AVX2) == ("AMD EPYC 7B12", ("avx2",))
    assert read_cpuinfo("") == ("", ())


@pytest.mark.parametrize(
    ("cpuinfo", "dtype", "precision"),
    [
        (INTEL_AMX, torch.bfloat16, "bf16-mixed"),
        (AMD_AVX2, torch.float32, "32-true"),
        (AVX512_NO_BF16, torch.float32, "32-true"),  # AVX-512 alone emulates bf16 too
        ("", torch.float32, "32-true"),  # nothing known: never bet on bf16
    ],
)
def test_auto_follows_the_cpu_flags(cpuinfo, dtype, precision):
    hardware = detect_hardware("cpu", cpuinfo=cpuinfo)
    assert resolve_dtype("auto", "cpu", hardware) is dtype
    assert resolve_precision("auto", "cpu", hardware) == precision


@pytest.mark.parametrize(
    ("cuda_bf16", "dtype", "precision"),
    [(True, torch.bfloat16, "bf16-mixed"), (False, torch.float16, "32-true")],
)
def test_auto_on_a_gpu_follows_its_bf16_support(cuda_bf16, dtype, precision):
    hardware = Hardware("cuda", "NVIDIA H100 80GB HBM3", cuda_bf16=cuda_bf16)
    assert resolve_dtype("auto", "cuda", hardware) is dtype
    assert resolve_precision("auto", "gpu", hardware) == precision


def test_explicit_settings_pass_through_whatever_the_hardware():
    amd = detect_hardware("cpu", cpuinfo=AMD_AVX2)
    assert resolve_dtype("bfloat16", "cpu", amd) is torch.bfloat16
    assert resolve_dtype(torch.float64, "cpu", amd) is torch.float64
    assert resolve_precision("bf16-mixed", "cpu", amd) == "bf16-mixed"
    assert resolve_precision(32, "cpu", amd) == "32"
    with pytest.raises(ValueError, match="'fp33' is not a torch dtype name"):
        resolve_dtype("fp33")


def test_the_reason_names_the_deciding_flags():
    assert "bf16 native (amx_bf16, avx512_bf16)" in detect_hardware("cpu", INTEL_AMX).reason()
    assert "no amx_bf16 / avx512_bf16" in detect_hardware("cpu", AMD_AVX2).reason()


def test_start_logs_the_machine_and_the_choices(caplog):
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="specdraft.system.hardware"):
            hardware = start("specdraft-test", 1, {"dtype": "float32"}, precision="32-true").hardware
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"specdraft-test on {hardware.name} (")
    assert "dtype float32 → float32; precision 32-true → 32-true; 1 torch threads" in line
