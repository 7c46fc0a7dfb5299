"""Print the CMAKE_ARGS that build llama.cpp (llama-cpp-python) for the CPU we run on.

A native build (`-march=native`) would also enable AMX on VMs that advertise it, where
llama_decode then crashes; a fixed list of x86 extensions, on the other hand, dies with
SIGILL on a CPU that lacks one of them (AVX-512 on an AMD Zen 3 guest, seen here). So the
extensions are switched on one by one from the flags the kernel reports, AMX always off.
"""

from __future__ import annotations

import sys
from pathlib import Path

# GGML option -> the /proc/cpuinfo flag that must be present for it.
GGML_OPTION_FLAGS: dict[str, str] = {
    "GGML_AVX": "avx",
    "GGML_AVX2": "avx2",
    "GGML_FMA": "fma",
    "GGML_F16C": "f16c",
    "GGML_BMI2": "bmi2",
    "GGML_AVX512": "avx512f",
    "GGML_AVX512_VBMI": "avx512vbmi",  # Linux's name (VBMI2 is avx512_vbmi2)
    "GGML_AVX512_VNNI": "avx512_vnni",
    "GGML_AVX512_BF16": "avx512_bf16",
    "GGML_AVX_VNNI": "avx_vnni",
}
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor listed in /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cmake_args(flags: set[str]) -> list[str]:
    """-D options for the given CPU flags; a non-x86 CPU gets a native build."""
    if "avx" not in flags and "sse2" not in flags:
        return ["-DGGML_NATIVE=ON"]
    args = ["-DGGML_NATIVE=OFF"]
    for option, flag in GGML_OPTION_FLAGS.items():
        args.append(f"-D{option}={'ON' if flag in flags else 'OFF'}")
    args.extend(f"-D{option}=OFF" for option in ALWAYS_OFF)
    return args


def main() -> int:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    print(" ".join(cmake_args(cpu_flags(text))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
