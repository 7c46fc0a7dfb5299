"""What this CPU can do: its flags from /proc/cpuinfo and the cores this process may use.

Its own module so that the native kernels' builds (runtime/kernels/native.py, keyed by these
flags) and the kernel plan (runtime/kernels/cpu.py, which asks whether those kernels build)
both read it without importing each other.

`LLMQ_CPU_LEVEL=avx2` makes an AVX-512 machine answer as an AVX2-only CPU would: its
AVX-512, AMX and VNNI flags are dropped, so the kernel plan is the AVX2 one, and the
native kernels are built without those instructions (`build_flags`). That is how the
AVX2 path's numbers are tested on AVX-512 hardware (its speed is not that of an AVX2 CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    cores: int

    @property
    def level(self) -> str:
        """The widest vector path: "amx", "avx512_bf16", "avx512", "avx2" or "baseline"."""
        for name, flag in (
            ("amx", "amx_bf16"),
            ("avx512_bf16", "avx512_bf16"),
            ("avx512", "avx512f"),
            ("avx2", "avx2"),
        ):
            if flag in self.flags:
                return name
        return "baseline"


LEVEL_ENV = "LLMQ_CPU_LEVEL"  # "avx2": answer as an AVX2-only CPU (tests and benches)
# what an AVX2-only CPU lacks, as /proc/cpuinfo's flag prefixes and gcc's switches
WIDER_THAN_AVX2 = ("avx512", "amx", "avx_vnni")
AVX2_BUILD_FLAGS = ("-mno-avx512f", "-mno-avxvnni")


def forced_level() -> str:
    """The level `LLMQ_CPU_LEVEL` forces ("" for none); only "avx2" is known."""
    level = os.environ.get(LEVEL_ENV, "")
    if level not in ("", "avx2"):
        raise ValueError(f"{LEVEL_ENV} must be avx2 or unset, got {level!r}")
    return level


def build_flags() -> tuple[str, ...]:
    """The compiler switches that keep a native build to the forced level (none unforced:
    -march=native is the CPU's own)."""
    return AVX2_BUILD_FLAGS if forced_level() == "avx2" else ()


@cache
def cpu_features() -> CpuFeatures:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:  # not Linux: assume the baseline
        pass
    if forced_level() == "avx2":
        flags = {f for f in flags if not f.startswith(WIDER_THAN_AVX2)}
    return CpuFeatures(frozenset(flags), len(os.sched_getaffinity(0)))
